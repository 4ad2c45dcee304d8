"""The vision side of a VLM as the layout planner sees it: parameters, activations and FLOPs per sample.

Core's planner (:mod:`loongforge.planner.memory`) sizes the decoder itself and asks the model flavor for the
parts outside it (``VLMFlavor.planner_parts``). Here the encoder and its projector (a Qwen ViT's patch
merger, or SigLIP's MLP projector) are one part, ``vision``, because that is how they run: a plain torch
module built on the first pipeline stage only, its gradients reduced and its optimizer state sharded over data
parallelism like the decoder's dense parameters. Over the decoder's tp ranks it runs one of three ways
(``model.encoder`` options, :mod:`loongforge_vlm.model.part_options`):

* replicated (default): every tp rank holds all of it and encodes every image;
* heterogeneous data parallelism (``data_parallel_over_tp``): every tp rank holds all of it but encodes a tp-th of
  the images, so its compute and activations per rank are divided by tp (the images are balanced by patches; the
  gathered features, ``vision_tokens x hidden`` per sample, are left out);
* encoder tensor parallelism (``tp``, Qwen ViT): the blocks' ``qkv``, ``out``, ``fc1`` and ``fc2`` weights (and the
  column-parallel biases) are split over tp, and with them the blocks' matmul and attention FLOPs and the
  activations of attention (``6d``) and the MLP; the norms' activations (``4d``), the patch embedding and the merger
  stay whole on every rank.

Assumptions, for a sample carrying ``vision_tokens`` LLM tokens from images:

* patches per sample = ``vision_tokens x merge**2`` (Qwen: 2x2 patches of 14 px merge into one token); one
  image per sample for Qwen (the attention span of a full-attention block is every patch of the sample;
  Qwen2.5-VL's windowed blocks attend within ``(window_size / patch_size)**2`` patches); SigLIP images are
  ``image_size`` px, so a sample holds ``patches / grid**2`` images of ``grid**2`` patches each.
* activations (elements per patch and block, what autograd keeps with SDPA, no ``s**2`` scores): two norms
  ``2 x 2d`` (input, output), attention ``6d`` (qkv output, rotated q and k, attention output), MLP
  QuickGELU ``3f`` (fc1 output, sigmoid, product) / SwiGLU ``4f`` (fc1 output 2f, SiLU, product) / GELU ``2f``;
  plus the patch embedding's input and the projector (Qwen merger ``4d``: norm input and output, fc1 and
  GELU outputs; SigLIP final norm and merged copy ``2d`` plus ``2 x hidden / merge**2``).
* recompute: the encoder follows its own switch, ``VLMFlavor.encoder_recompute`` (the decoder's
  ``model.recompute`` does not reach it). With it each block keeps only its input (``d``). The block it
  re-runs in the backward is not added: the encoder's backward comes last, when the decoder's activations are
  already freed, so it never meets the step's peak (measured on the CPU build, see docs/planner.md).
* FLOPs: ``6 x`` the matmul parameters each patch (blocks, patch embedding) or merged token (projector)
  passes through, plus bidirectional attention ``12 x span x d`` per patch and block; recompute adds the
  encoder's forward once more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge_vlm.encoders.internvit_flavors import InternViTFlavor
from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor


@dataclass(frozen=True)
class VisionPart:
    """The encoder + projector of one VLM flavor for samples with ``vision_tokens`` image tokens each."""

    flavor: Any  # VLMFlavor (not imported: flavors.py imports this module)
    vision_tokens: int
    name: str = "vision"

    @property
    def encoder(self) -> Any:
        return self.flavor.encoder

    @property
    def qwen(self) -> bool:
        return isinstance(self.encoder, QwenViTFlavor)

    @property
    def patches(self) -> int:
        """ViT patches per sample."""
        return self.vision_tokens * self.flavor.spatial_merge_size ** 2

    @property
    def description(self) -> str:
        """One line for ``loongforge plan``."""
        kind = f"{self.encoder.family} ViT" if self.qwen else "SigLIP + MLP projector"
        if isinstance(self.encoder, InternViTFlavor):
            kind = "InternViT + pixel-shuffle projector"
        split = {"heads": "split over tp (encoder tp)", "images": "replicated over tp, images shared out over tp",
                 None: "replicated over tp"}[self.split]
        return (f"{kind}, {self.params / 1e9:.3g}B params {split}, {self.encoder.num_layers} layers "
                f"d{self.encoder.dim}, {self.vision_tokens} vision tokens = {self.patches} patches per sample, "
                f"recompute {'on' if self.flavor.encoder_recompute else 'off'}")

    @property
    def params(self) -> int:
        """Encoder + projector parameters (the model's own count; a Qwen ViT includes its patch merger)."""
        from loongforge_vlm.model.flavors import num_params

        return num_params(self.flavor) - self.flavor.foundation.num_params()

    @property
    def split(self) -> str | None:
        """How the part divides its work over the decoder's tp ranks: ``heads`` (encoder tensor parallelism),
        ``images`` (heterogeneous data parallelism) or ``None`` (replicated)."""
        options = self.flavor.encoder_options
        return "heads" if options.tp > 1 else "images" if options.data_parallel_over_tp else None

    def _heads_tp(self, candidate: Any) -> int:
        """What divides the blocks' weights, matmuls and attention activations: the candidate's tp with encoder tp."""
        return candidate.tp if self.split == "heads" else 1

    def _images_tp(self, candidate: Any) -> int:
        """What divides the images each rank encodes: the candidate's tp with heterogeneous data parallelism."""
        return candidate.tp if self.split == "images" else 1

    def block_split_params(self) -> int:
        """Parameters of one block that encoder tp splits: ``qkv`` and ``fc1`` (weights and biases), the ``out`` and
        ``fc2`` weights."""
        enc, d = self.encoder, self.encoder.dim
        f_rows = 2 * enc.ffn_dim if enc.gated_mlp else enc.ffn_dim
        return 3 * d * d + 3 * d + d * d + f_rows * d + f_rows + enc.ffn_dim * d

    def param_count(self, candidate: Any) -> int:
        """On every rank of the first stage: whole, or with its blocks' matmul weights divided by encoder tp."""
        split = self.encoder.num_layers * self.block_split_params() if self.split == "heads" else 0
        return self.params - split + split // self._heads_tp(candidate)

    # -- activations ------------------------------------------------------------------------------------------

    def _mlp_width(self) -> int:
        """Elements the MLP keeps per patch."""
        f = self.encoder.ffn_dim
        if not self.qwen:
            return 2 * f  # fc1 output (GELU input), GELU output
        return 4 * f if self.encoder.gated_mlp else 3 * f

    def block_elements(self, heads_tp: int = 1) -> float:
        """Elements one block keeps per patch without recompute: norms 4d, attention 6d, the MLP (the last two
        divided by encoder tp)."""
        return 4 * self.encoder.dim + (6 * self.encoder.dim + self._mlp_width()) / heads_tp

    def edge_elements(self) -> float:
        """Elements kept per patch outside the blocks: the patch embedding's input and the projector."""
        d, merge = self.encoder.dim, self.flavor.spatial_merge_size ** 2
        if self.qwen:
            return self.encoder.patch_dim + 4 * d
        hidden = self.flavor.projector.hidden_dim or self.flavor.foundation.hidden_size
        return self.encoder.patch_dim + 2 * d + 2 * hidden / merge

    def sample_activation_elements(self, heads_tp: int = 1) -> float:
        """Elements the vision part holds for one sample at its peak (see the module docstring)."""
        layers = self.encoder.num_layers
        per_patch = self.edge_elements()
        if self.flavor.encoder_recompute:
            per_patch += layers * self.encoder.dim  # block inputs
        else:
            per_patch += layers * self.block_elements(heads_tp)
        return per_patch * self.patches

    def activation_bytes(self, candidate: Any, tokens: int, workload: Any) -> float:
        """Bytes for one micro-batch (``candidate.micro_batch_size`` samples; the encoder sees whole samples
        whatever the decoder's cp), on one rank."""
        per_sample = self.sample_activation_elements(self._heads_tp(candidate)) / self._images_tp(candidate)
        return per_sample * candidate.micro_batch_size * workload.param_bytes

    # -- FLOPs ------------------------------------------------------------------------------------------------

    def attention_spans(self) -> list[int]:
        """Patches each patch attends to, per block."""
        enc = self.encoder
        if not self.qwen:
            return [min(self.patches, enc.grid_size ** 2)] * enc.num_layers
        window = min(self.patches, (enc.window_size // enc.patch_size) ** 2) if enc.windowed else self.patches
        return [self.patches if not enc.windowed or i in enc.full_attention_blocks else window
                for i in range(enc.num_layers)]

    def forward_flops(self) -> tuple[float, float]:
        """Forward FLOPs of one sample, ``(whole, split)``: 2 x matmul parameters per patch / merged token, split in
        what encoder tp divides (the blocks' matmuls and attention) and what every rank runs whole (patch embedding,
        projector)."""
        enc, d = self.encoder, self.encoder.dim
        f_rows = 2 * enc.ffn_dim if self.qwen and enc.gated_mlp else enc.ffn_dim
        block = d * 3 * d + d * d + d * f_rows + enc.ffn_dim * d
        if self.qwen:
            merged = d * self.flavor.spatial_merge_size ** 2
            projector = merged * merged + merged * enc.out_dim
        else:
            hidden = self.flavor.projector.hidden_dim or self.flavor.foundation.hidden_size
            projector = d * self.flavor.spatial_merge_size ** 2 * hidden + hidden * self.flavor.foundation.hidden_size
        attention = sum(4 * span * d for span in self.attention_spans())  # QK^T and AV, bidirectional
        whole = self.patches * 2 * enc.patch_dim * d + self.vision_tokens * 2 * projector
        return whole, self.patches * (2 * enc.num_layers * block + attention)

    def forward_flops_per_sample(self) -> float:
        """Forward FLOPs of one sample: 2 x matmul parameters per patch / merged token, plus attention."""
        return sum(self.forward_flops())

    def _passes(self) -> int:
        """Forward + 2x backward, and the re-run forward with recompute."""
        return 4 if self.flavor.encoder_recompute else 3

    def flops_per_sample(self, workload: Any) -> float:
        """Training FLOPs of one sample, what the model costs (MFU counts these)."""
        return self.forward_flops_per_sample() * self._passes()

    def rank_flops_per_sample(self, workload: Any, candidate: Any) -> float:
        """Training FLOPs one first-stage rank spends per sample of its data-parallel share: all of them replicated,
        a tp-th with heterogeneous DP, the blocks' share divided by tp with encoder tp."""
        whole, split = self.forward_flops()
        forward = (whole + split / self._heads_tp(candidate)) / self._images_tp(candidate)
        return forward * self._passes()

def vision_tokens(flavor: Any, config: Any) -> int:
    """LLM tokens per sample from images: ``model.overrides.vision_tokens_per_sample``, by default half of the
    sequence (an image-text sample); a one-line error outside ``0..data.seq_length``."""
    from loongforge.errors import ConfigError

    given, seq = flavor.vision_tokens_per_sample, config.data.seq_length
    if given is not None and not 0 <= given <= seq:
        raise ConfigError(f"{config.source}: model.overrides.vision_tokens_per_sample must be between 0 and "
                          f"data.seq_length ({seq}), got {given}")
    return seq // 2 if given is None else given


def vision_parts(flavor: Any, config: Any) -> tuple[VisionPart, ...]:
    """What ``VLMFlavor.planner_parts`` returns: the vision part (none for text-only samples)."""
    tokens = vision_tokens(flavor, config)
    return (VisionPart(flavor, tokens),) if tokens > 0 else ()
