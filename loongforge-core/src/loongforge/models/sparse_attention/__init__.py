"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) as torch operators.

- :mod:`.indexer`: the lightning indexer (:class:`LightningIndexer`, transformers' ``DeepseekV32Indexer`` math) and
  its top-k selection, blockwise (:func:`select_topk`) or dense (:func:`index_scores_reference`,
  :func:`select_topk_reference`);
- :mod:`.sparse_attention`: causal attention over the selected keys for MLA-shaped heads, efficient
  (:func:`sparse_attention`, gathers only the top-k keys per query) and dense-masked
  (:func:`sparse_attention_reference`);
- :mod:`.losses`: the indexer's KL loss, dense warm-up and sparse phase (:func:`indexer_kl_loss`,
  :func:`indexer_kl_loss_reference`), and :func:`attach_indexer_loss`;
- :mod:`.core_attention` (imports megatron-core, so not re-exported here): :class:`DSACoreAttention`, the whole
  thing as megatron MLA's core attention, with the training phases.
"""

from __future__ import annotations

from loongforge.models.sparse_attention.indexer import (
    IndexerProjections,
    LightningIndexer,
    apply_rope_first,
    index_scores_reference,
    rope_cos_sin,
    select_topk,
    select_topk_reference,
)
from loongforge.models.sparse_attention.losses import (
    attach_indexer_loss,
    gathered_index_scores,
    indexer_kl_loss,
    indexer_kl_loss_reference,
    set_indexer_loss_scale,
)
from loongforge.models.sparse_attention.sparse_attention import (
    absorb_mla,
    sparse_attention,
    sparse_attention_reference,
    sparse_head_sum,
    topk_mask,
)

__all__ = ["IndexerProjections", "LightningIndexer", "absorb_mla", "apply_rope_first", "attach_indexer_loss",
           "gathered_index_scores", "index_scores_reference", "indexer_kl_loss", "indexer_kl_loss_reference",
           "rope_cos_sin", "select_topk", "select_topk_reference", "set_indexer_loss_scale", "sparse_attention",
           "sparse_attention_reference", "sparse_head_sum", "topk_mask"]
