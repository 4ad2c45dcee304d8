"""``VisionLanguageModel``: a vision encoder and projector feeding a core megatron ``GPTModel``.

The encoder (and projector) are plain torch modules, replicated on every rank; the language model is the
megatron ``GPTModel`` that core builds for any :class:`~loongforge.models.flavor.DecoderFlavor`, so tensor,
sequence and pipeline parallelism apply to it unchanged. The forward pass embeds the text with the
``GPTModel``'s own embedding (built to return the whole sequence), writes the vision features into the
image/video placeholder positions, scatters the result over the sequence-parallel ranks when sequence
parallelism is on, and runs the decoder from that ``decoder_input`` in megatron's ``[seq, batch, hidden]``
layout. With labels it returns the per-token loss, like core's ``GPTModel`` path in the trainer. A Qwen3-VL
encoder's DeepStack features reach the first decoder layers through :mod:`loongforge_vlm.model.deepstack`; an AnyRes
SigLIP tower's tile features are packed per image by :mod:`loongforge_vlm.model.anyres`.
"""

from __future__ import annotations

from typing import Any

import torch
from loongforge.errors import LoongForgeError
from loongforge.models.chunks import ChunkBuild
from loongforge.models.decoder_model import ParallelSettings, resolve_dtype
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from torch import nn

from loongforge_vlm.encoders.internvit import InternViT, InternViTFlavor
from loongforge_vlm.encoders.qwen_vit import QwenViT
from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.encoders.siglip import SiglipFlavor, SiglipVisionEncoder
from loongforge_vlm.encoders.tensor_parallel import shard_heads_and_mlp
from loongforge_vlm.model.anyres import pack_images
from loongforge_vlm.model.deepstack import DeepStackInjection, check_recompute
from loongforge_vlm.model.encoder_data_parallel import EncoderDataParallel, average_over_tp
from loongforge_vlm.model.flavors import VLMFlavor, encoder_tp_problem
from loongforge_vlm.model.position_ids import mrope_position_ids, text_position_ids
from loongforge_vlm.projectors import MlpProjector


def _check_counts(kind: str, placeholders: list[int], features: list[int]) -> None:
    """Each sample's placeholder count must equal the features of the images/videos that fall to it, in order."""
    item = 0
    for sample, count in enumerate(placeholders):
        first, got = item, 0
        while got < count and item < len(features):
            got += features[item]
            item += 1
        if got != count:
            which = f"{kind}s {first}..{item - 1}" if item > first else f"no {kind}"
            raise LoongForgeError(f"sample {sample}: {count} {kind} placeholder token(s), but {which} give {got} "
                                  f"{kind} feature(s); the text must hold one placeholder per feature")
    if item != len(features):
        raise LoongForgeError(f"{len(features) - item} {kind}(s) left without placeholder tokens in the batch "
                              f"({len(features)} {kind}s, {sum(placeholders)} placeholder tokens)")


def padding_attention_mask(padding: torch.Tensor) -> torch.Tensor | None:
    """Megatron's ``[B, 1, S, S]`` mask (``True`` = masked out) for a ``(B, S)`` padding mask (1 = real token).

    ``None`` (the plain causal path) when no sample has padding before a real token: then causal attention
    never lets a real token see padding. A padding query may always see itself, so no row is fully masked.
    """
    keep = padding.bool()
    length = keep.shape[1]
    prefix = torch.arange(length, device=keep.device) < keep.sum(-1, keepdim=True)
    if bool((keep == prefix).all()):  # right padding only
        return None
    causal = torch.ones(length, length, dtype=torch.bool, device=keep.device).tril()
    allowed = causal & keep[:, None, :] | torch.eye(length, dtype=torch.bool, device=keep.device)
    return ~allowed[:, None]


class VisionLanguageModel(MegatronModule):
    """``encoder`` (+ ``projector``) -> vision tokens at the placeholder positions -> ``language_model``.

    ``projector`` is ``None`` for the Qwen encoders, whose patch merger already maps to the backbone's width.
    On a pipeline stage without the embedding (``language_model.pre_process`` false) the vision parts are
    absent and the stage just runs its decoder layers on the received activations. A ``MegatronModule`` with
    the backbone's config, so megatron's schedules, DDP and ``sharded_state_dict`` (the vision parts as
    tensors replicated over TP) take it like a ``GPTModel``.
    """

    def __init__(self, flavor: VLMFlavor, language_model: Any, encoder: nn.Module | None,
                 projector: nn.Module | None, encoder_data_parallel: EncoderDataParallel | None = None) -> None:
        super().__init__(config=language_model.config)
        self.flavor = flavor
        self.encoder = encoder
        self.projector = projector
        #: The TP group over which the images are shared out (``model.encoder.data_parallel_over_tp``), or ``None``.
        self.encoder_data_parallel = encoder_data_parallel
        self.language_model = language_model
        #: The AnyRes geometry of a tiling SigLIP tower (``None``: every tile is one image's features as it is).
        self.anyres = anyres_layout(flavor)
        self.deepstack = None
        if encoder is not None and flavor.deepstack_levels:
            check_recompute(language_model.config)
            self.deepstack = DeepStackInjection(list(language_model.decoder.layers)[:flavor.deepstack_levels])

    def component_parameters(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """Named parameters of one part -- ``encoder``, ``projector`` or ``foundation`` -- for per-part freezing
        and learning rates. A Qwen encoder's patch merger counts as the projector."""
        merged = self.projector is None and self.encoder is not None
        parts: dict[str, list[tuple[str, nn.Parameter]]] = {"encoder": [], "projector": [], "foundation": []}
        for full_name, param in self.named_parameters():
            if full_name.startswith("language_model."):
                parts["foundation"].append((full_name, param))
            elif full_name.startswith("projector.") or (merged and full_name.startswith("encoder.merger.")):
                parts["projector"].append((full_name, param))
            else:
                parts["encoder"].append((full_name, param))
        if name not in parts:
            raise LoongForgeError(f"unknown VLM component {name!r}; known: {', '.join(parts)}")
        return parts[name]

    @property
    def model_type(self) -> Any:
        """Megatron's schedules ask the model for its type: the backbone's."""
        return self.language_model.model_type

    @property
    def pre_process(self) -> bool:
        """Whether this chunk is the first pipeline stage (holds the embedding): the backbone's. Megatron's gradient
        finalisation finds the chunk that ties the embedding to the output layer by this attribute."""
        return self.language_model.pre_process

    @property
    def post_process(self) -> bool:
        return self.language_model.post_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> Any:
        """The backbone's tied word-embedding / output weight, which megatron all-reduces between the first and the
        last pipeline stage."""
        return self.language_model.shared_embedding_or_output_weight()

    def kv_cache_decoder(self) -> Any:
        """The backbone, whose attention keeps the KV cache when core decodes this model
        (:class:`loongforge.models.generate.ComposedDecoder`)."""
        return self.language_model

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron's pipeline schedule hands the previous stage's activations in here."""
        self.language_model.set_input_tensor(input_tensor)

    def _vision_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One ``(tokens, hidden)`` tensor per image (or video; per tile of a tiled one), and the DeepStack features of
        all of them, one ``(all tokens, hidden)`` tensor per level (none without DeepStack). With heterogeneous data
        parallelism (:attr:`encoder_data_parallel`) this rank encodes its share of the items (tiles) and the group
        gathers the rest; AnyRes packs the gathered tiles into images afterwards."""
        if self.projector is None:
            patches = grid_thw.prod(-1)
            tokens = (patches // self.flavor.spatial_merge_size ** 2).tolist()
            starts = [0, *patches.cumsum(0).tolist()]

            def encode(items: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
                rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in items])
                return self.encoder.encode(pixel_values[rows], grid_thw[items])

            costs = patches.tolist()
        else:
            grid = self.encoder.grid(*pixel_values.shape[-2:])
            costs = [grid[0] * grid[1]] * pixel_values.shape[0]
            rows, cols = self.projector.output_grid(grid)
            tokens = [rows * cols] * pixel_values.shape[0]

            def encode(items: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
                return self.projector(self.encoder(pixel_values[items]), grid).flatten(0, 1), []

        if self.encoder_data_parallel is None:
            merged, deepstack = encode(list(range(len(costs))))
        else:
            vision = [p for part in (self.encoder, self.projector) if part is not None for p in part.parameters()]
            merged, deepstack = self.encoder_data_parallel.encode(
                encode, costs, tokens, width=self.language_model.config.hidden_size,
                levels=1 + self.flavor.deepstack_levels, dtype=vision[0].dtype,
                requires_grad=torch.is_grad_enabled() and any(p.requires_grad for p in vision))
        features = list(merged.split(tokens))
        if self.anyres is not None:
            features = pack_images(features, grid_thw, self.anyres, self.projector.newline)
        return features, deepstack

    def _scatter(self, embeddings: torch.Tensor, input_ids: torch.Tensor, token_id: int, kind: str,
                 features: list[torch.Tensor], deepstack: list[torch.Tensor], residuals: list[torch.Tensor],
                 media_columns: int | None = None) -> torch.Tensor:
        """``embeddings`` ``(B, S, H)`` with the features written into the ``token_id`` positions (of the first
        ``media_columns`` columns, when given), in order; the DeepStack features are written into the same positions
        of ``residuals`` (one ``(B, S, H)`` per level)."""
        mask = input_ids == token_id
        if media_columns is not None:
            mask[:, media_columns:] = False
        _check_counts(kind, mask.sum(-1).tolist(), [f.shape[0] for f in features])
        flat = torch.cat(features).to(embeddings.dtype)
        for level, level_features in enumerate(deepstack):
            residuals[level] = residuals[level].masked_scatter(mask[..., None], level_features.to(embeddings.dtype))
        return embeddings.masked_scatter(mask[..., None], flat)

    def embed(self, input_ids: torch.Tensor, *, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
              video_grid_thw: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
              media_columns: int | None = None) -> torch.Tensor:
        """The decoder input ``[S, B, H]`` (this rank's sequence slice under sequence parallelism).

        ``position_ids (B, S)`` reach a foundation that learns absolute positions (GPT-2): its embedding adds them
        to the tokens' (a rotary foundation rotates in attention instead); default :meth:`position_ids`."""
        embedding = self.language_model.embedding
        if embedding.add_position_embedding:
            if position_ids is None or position_ids.ndim != 2:
                position_ids = text_position_ids(input_ids, None)
        else:
            position_ids = None
        text = embedding(input_ids=input_ids, position_ids=position_ids)  # [S, B, H], whole sequence
        embeddings = text.transpose(0, 1)
        residuals = [torch.zeros_like(embeddings) for _ in range(self.flavor.deepstack_levels)]
        if pixel_values is not None:
            features, deepstack = self._vision_features(pixel_values, image_grid_thw)
            embeddings = self._scatter(embeddings, input_ids, self.flavor.image_token_id, "image", features,
                                       deepstack, residuals, media_columns)
        if pixel_values_videos is not None:
            if self.flavor.video_token_id is None:
                raise LoongForgeError("this model has no video token (flavor.video_token_id is None)")
            features, deepstack = self._vision_features(pixel_values_videos, video_grid_thw)
            embeddings = self._scatter(embeddings, input_ids, self.flavor.video_token_id, "video", features,
                                       deepstack, residuals, media_columns)
        if self.deepstack is not None:
            has_vision = pixel_values is not None or pixel_values_videos is not None
            self.deepstack.residuals = [self._decoder_layout(r) for r in residuals] if has_vision else None
        return self._decoder_layout(embeddings)

    def _decoder_layout(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, S, H)`` -> the decoder's ``[S, B, H]`` (this rank's slice under sequence parallelism)."""
        hidden = hidden.transpose(0, 1).contiguous()
        if self.language_model.config.sequence_parallel:
            hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        return hidden

    def position_ids(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                     image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                     second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        """``(3, B, S)`` M-RoPE ids for a Qwen-style backbone, else ``(B, S)`` 1D ids."""
        padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
        if not self.flavor.uses_mrope:
            return text_position_ids(input_ids, padding)
        return mrope_position_ids(
            input_ids, spatial_merge_size=self.flavor.spatial_merge_size, image_token_id=self.flavor.image_token_id,
            video_token_id=self.flavor.video_token_id, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            attention_mask=padding, second_per_grid_ts=second_per_grid_ts,
            tokens_per_second=self.flavor.tokens_per_second, timestamped_videos=self.flavor.timestamped_videos,
        )[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        inference_context: Any = None,
        runtime_gather_output: bool | None = None,
        media_columns: int | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Logits ``(B, S, vocab)``, or the per-token loss ``(B, S)`` when ``labels`` are given.

        ``loss_mask`` reaches a foundation with multi-token-prediction blocks (DeepSeek-V3), whose loss counts the
        same targets as the main loss (the answers, in SFT); other foundations take no mask.
        ``attention_mask`` is either a ``(B, S)`` padding mask (1 = real token; left or right padding) or
        megatron's ``[B, 1, S, S]`` boolean mask (``True`` = masked out), passed through; packed rows may instead come
        as ``packed_seq_params`` (their sample boundaries, :class:`~loongforge.parallel.packed_rows.PackedRows`),
        which the backbone's attention reads without a mask. Images: Qwen
        encoders take the processor's ``pixel_values`` ``(patches, patch_dim)`` with ``image_grid_thw``; a
        SigLIP encoder takes ``(images, C, H, W)``. ``position_ids`` default to :meth:`position_ids`; an M-RoPE
        model also accepts ``(B, S)`` ids for text-only batches (all three rows equal).

        ``inference_context`` and ``runtime_gather_output`` reach the backbone's KV-cache decoding (core's
        :mod:`loongforge.models.generate`): the prefill brings the vision inputs, each cached step only new text
        tokens, and an M-RoPE step the positions of the whole context (megatron rotates the cached keys by them).
        ``media_columns``: only the first that many columns hold placeholders (a generated context recomputed
        without a cache: a token written after the prompts is text even when it is a placeholder id).
        """
        mask = attention_mask
        if attention_mask is not None and attention_mask.ndim == 2:
            mask = padding_attention_mask(attention_mask)
        has_vision = pixel_values is not None or pixel_values_videos is not None
        if position_ids is not None and position_ids.ndim == 2 and self.flavor.uses_mrope:
            # 1D text positions (what data pipelines and core's trainer pass): text alone has three equal rows;
            # with images the rows differ, so the ids come from the tokens and grids instead. Over a packed row
            # that shifts each later sample by one constant, which rotary attention within a sample cannot see.
            position_ids = None if has_vision else position_ids.unsqueeze(0).expand(3, -1, -1)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, attention_mask=attention_mask, image_grid_thw=image_grid_thw,
                                             video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts)
        decoder_input = None
        if self.language_model.pre_process:
            decoder_input = self.embed(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                       pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                                       position_ids=position_ids, media_columns=media_columns)
        extra = {} if loss_mask is None else {"loss_mask": loss_mask}
        if packed_seq_params is not None:
            extra["packed_seq_params"] = packed_seq_params
        if inference_context is not None:
            extra.update(inference_context=inference_context, runtime_gather_output=runtime_gather_output)
        return self.language_model(input_ids, position_ids, mask, decoder_input=decoder_input, labels=labels,
                                   **extra)


def build_vlm(flavor: VLMFlavor, *, backend: Any, params_dtype: str | torch.dtype = "fp32",
              parallel: ParallelSettings | None = None, pre_process: bool = True, post_process: bool = True,
              vp_stage: int | None = None, extra_config: dict[str, Any] | None = None,
              seed: int | None = None) -> VisionLanguageModel:
    """The composed model for ``flavor`` through the one builder (``VLMFlavor.build_chunk``): core builds the
    backbone, the vision parts are built on the first pipeline stage only. ``seed=None`` draws the weights from
    the current random state. Megatron's parallel state must be initialised (as for ``build_model``)."""
    return flavor.build_chunk(ChunkBuild(
        backend=backend, params_dtype=params_dtype, parallel=parallel or ParallelSettings(), pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage, extra_config=extra_config or {}, seed=seed))


def compose_vlm(flavor: VLMFlavor, language_model: Any, *, seed: int | None = None,
                params_dtype: str | torch.dtype = "fp32") -> VisionLanguageModel:
    """``language_model`` (a core ``GPTModel`` chunk built from ``flavor.foundation``) with the vision parts in
    front when it is the first pipeline stage. ``seed`` initialises them from a private generator state, so every
    rank gets the same vision weights whatever the layout (``None``: the current random state)."""
    encoder = projector = data_parallel = None
    if language_model.pre_process:
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            encoder, projector = _vision_parts(flavor)
        encoder.recompute = flavor.encoder_recompute
        dtype = resolve_dtype(params_dtype)
        encoder = encoder.to(dtype)
        projector = projector.to(dtype) if projector is not None else None
        data_parallel = _encoder_data_parallel(flavor, encoder, projector)
        _encoder_tensor_parallel(flavor, encoder)
    return VisionLanguageModel(flavor, language_model, encoder, projector, data_parallel)


def _encoder_data_parallel(flavor: VLMFlavor, encoder: nn.Module, projector: nn.Module | None
                           ) -> EncoderDataParallel | None:
    """The decoder's TP group as the encoder's data-parallel group, when ``model.encoder.data_parallel_over_tp`` asks
    for it and tp > 1; the vision parameters are then averaged over that group (see
    :mod:`loongforge_vlm.model.encoder_data_parallel`)."""
    size = parallel_state.get_tensor_model_parallel_world_size()
    if not flavor.encoder_options.data_parallel_over_tp or size == 1:
        return None
    average_over_tp(encoder, projector)
    return EncoderDataParallel(parallel_state.get_tensor_model_parallel_group(),
                               parallel_state.get_tensor_model_parallel_rank(), size)


def _encoder_tensor_parallel(flavor: VLMFlavor, encoder: nn.Module) -> None:
    """Split the encoder's heads and MLP over the decoder's TP group when ``model.encoder.tp`` asks for it
    (:mod:`loongforge_vlm.encoders.tensor_parallel`)."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    problem = encoder_tp_problem(flavor, world)
    if problem:
        raise LoongForgeError(problem)
    if flavor.encoder_options.tp > 1 and world > 1:
        shard_heads_and_mlp(encoder.blocks, flavor.encoder_options.tp)


def anyres_layout(flavor: VLMFlavor) -> Any:
    """The :class:`~loongforge_vlm.encoders.anyres.AnyResLayout` of a flavor whose SigLIP tower tiles (else
    ``None``)."""
    if not isinstance(flavor.encoder, SiglipFlavor):
        return None
    return flavor.encoder.anyres_layout(flavor.projector.merge)  # type: ignore[union-attr]


def _vision_parts(flavor: VLMFlavor) -> tuple[nn.Module, nn.Module | None]:
    """Freshly initialised encoder and (separate) projector (with AnyRes's newline token when the tower tiles)."""
    if isinstance(flavor.encoder, QwenViTFlavor):
        return QwenViT(flavor.encoder), None
    tower = InternViT if isinstance(flavor.encoder, InternViTFlavor) else SiglipVisionEncoder
    encoder, spec = tower(flavor.encoder), flavor.projector
    return encoder, MlpProjector(flavor.encoder.dim, flavor.foundation.hidden_size, hidden_dim=spec.hidden_dim,
                                 merge=spec.merge, norm=spec.norm, newline=anyres_layout(flavor) is not None)
