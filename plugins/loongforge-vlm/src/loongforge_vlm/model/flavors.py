"""``VLMFlavor``: a vision-language model named by its parts -- encoder, projector, language backbone, token ids.

Torch-free, because the plugin registers these objects and ``loongforge list`` must stay instant. The
backbone is a core :class:`~loongforge.models.flavor.DecoderFlavor`, so any family core builds (Llama, Qwen2,
Qwen3, MoE) can sit behind any encoder; swapping it is ``dataclasses.replace(flavor, foundation=...)``.
Qwen2-VL / Qwen2.5-VL are a Qwen ViT whose patch merger *is* the projector (``projector=None``: the encoder's
output already has the backbone's width) in front of a Qwen2 decoder with multimodal RoPE; Qwen3-VL is the
Qwen3-VL ViT (with DeepStack, :mod:`loongforge_vlm.model.deepstack`) in front of a Qwen3 decoder (dense, or
Qwen3-MoE for the A3B/A22B sizes) with interleaved multimodal RoPE. The real sizes carry the published
``config.json`` values of Qwen/Qwen2-VL-2B/7B-Instruct, Qwen/Qwen2.5-VL-3B/7B-Instruct and
Qwen/Qwen3-VL-2B/8B/30B-A3B/235B-A22B-Instruct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.flavor import DecoderFlavor, replace_fields
from loongforge.models.listing import count_of_shapes, size_label
from loongforge.models.llama import FLAVORS as LLAMA_FLAVORS

from loongforge_vlm.encoders.internvit_flavors import INTERNVIT_FLAVORS, InternViTFlavor
from loongforge_vlm.encoders.internvit_flavors import num_params as internvit_num_params
from loongforge_vlm.encoders.qwen_vit_flavors import FLAVORS as QWEN_VIT_FLAVORS
from loongforge_vlm.encoders.qwen_vit_flavors import TITLES as QWEN_VIT_TITLES
from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.encoders.qwen_vit_flavors import num_params as qwen_vit_num_params
from loongforge_vlm.encoders.siglip_flavors import SIGLIP_FLAVORS, SiglipFlavor
from loongforge_vlm.encoders.siglip_flavors import num_params as siglip_num_params
from loongforge_vlm.model.part_options import PartOptions, parameter_groups


@dataclass(frozen=True)
class MlpProjectorFlavor:
    """The LLaVA-style projector (:class:`~loongforge_vlm.projectors.MlpProjector`) after an encoder without one:
    ``merge x merge`` patches concatenated, then ``Linear -> GELU -> Linear`` (hidden width ``hidden_dim``, by
    default the backbone's width); ``norm``: a LayerNorm on the merged tokens first (InternVL's projector)."""

    merge: int = 1
    hidden_dim: int | None = None
    norm: bool = False


#: The roles of a VLM's parts (``model: {encoder: ..., projector: ..., foundation: ...}``).
PART_ROLES: tuple[str, ...] = ("encoder", "projector", "foundation")
#: Batch keys beside the text that a VLM's forward takes (core's megatron engine passes those a batch has).
EXTRA_INPUTS: tuple[str, ...] = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                 "second_per_grid_ts")


@dataclass(frozen=True)
class VLMFlavor(ModelFamily):
    """Encoder + projector + language backbone, and the token ids that place vision features in the text.

    ``image_token_id`` (and ``video_token_id``) mark the placeholder positions that receive one vision feature
    each. ``vision_start_token_id``/``vision_end_token_id`` are the markers around them (the model does not
    need them; chat templates and data pipelines do). ``tokens_per_second`` scales the temporal M-RoPE
    position of video frames (Qwen2.5-VL; ``None``: frame index). ``hf_architecture`` names the transformers
    class a checkpoint of this flavor converts to (``None``: no Hugging Face layout).
    ``vision_tokens_per_sample`` is what the layout planner assumes of the data: LLM tokens per sample that come
    from images (``None``: half of ``data.seq_length``; set it with ``model.overrides.vision_tokens_per_sample``).
    """

    part_roles: ClassVar[tuple[str, ...]] = PART_ROLES
    extra_inputs: ClassVar[tuple[str, ...]] = EXTRA_INPUTS

    encoder: QwenViTFlavor | SiglipFlavor | InternViTFlavor
    foundation: DecoderFlavor
    image_token_id: int
    projector: MlpProjectorFlavor | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    tokens_per_second: float | None = None
    hf_architecture: str | None = None
    #: Recompute the encoder's blocks in the backward, independently of the LLM's ``model.recompute``
    #: (set it with ``model.overrides.encoder_recompute: true``).
    encoder_recompute: bool = False
    vision_tokens_per_sample: int | None = None
    #: How each part trains, by role (``model.<role>: {lr, min_lr, weight_decay, freeze, unfreeze_at_step}``, see
    #: :mod:`loongforge_vlm.model.part_options`); a part not listed follows ``optimizer:``.
    part_options: tuple[tuple[str, PartOptions], ...] = ()

    def __post_init__(self) -> None:
        width = self.foundation.hidden_size
        qwen = isinstance(self.encoder, QwenViTFlavor)
        if qwen and self.projector is not None:
            raise ConfigError("vlm flavor: a Qwen ViT ends in its own patch merger; set projector to None")
        if not qwen and self.projector is None:
            raise ConfigError("vlm flavor: a SigLIP encoder needs a projector (MlpProjectorFlavor)")
        if qwen and self.encoder.out_dim != width:
            raise ConfigError(f"vlm flavor: the encoder's patch merger outputs {self.encoder.out_dim} features, the "
                              f"backbone's hidden_size is {width}; set the encoder's out_dim to {width}")
        if self.foundation.mrope_section is not None and not qwen:
            raise ConfigError("vlm flavor: M-RoPE (foundation.mrope_section) needs an encoder with a (t, h, w) grid "
                              "(a Qwen ViT)")
        ids = [i for i in (self.image_token_id, self.video_token_id, self.vision_start_token_id,
                           self.vision_end_token_id) if i is not None]
        outside = [i for i in ids if not 0 <= i < self.foundation.vocab_size]
        if outside:
            raise ConfigError(f"vlm flavor: token id(s) {outside} outside the vocabulary "
                              f"0..{self.foundation.vocab_size - 1}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"vlm flavor: image/video/vision-start/vision-end token ids must differ, got {ids}")
        if self.video_token_id is not None and not qwen:
            raise ConfigError("vlm flavor: videos need a Qwen ViT encoder (it embeds frames with grid_thw)")
        if not qwen and self.encoder.grid_size % self.projector.merge:  # type: ignore[union-attr]
            side, merge = self.encoder.grid_size, self.projector.merge  # type: ignore[union-attr]
            pixels = f"{self.encoder.image_size}px in {self.encoder.patch_size}px patches"
            raise ConfigError(f"vlm flavor: model.projector.merge={merge} does not divide the encoder's {side}x{side} "
                              f"patch grid ({pixels}); pick a merge that divides it")
        if self.deepstack_levels > self.foundation.num_layers:
            raise ConfigError(f"vlm flavor: {self.deepstack_levels} DeepStack feature sets need as many decoder "
                              f"layers, the backbone has {self.foundation.num_layers}")

    @property
    def encoder_options(self) -> PartOptions:
        """The encoder's part options (``model.encoder.<option>``); defaults when none are set."""
        return dict(self.part_options).get("encoder", PartOptions())

    @property
    def deepstack_levels(self) -> int:
        """How many of the first decoder layers receive DeepStack features (Qwen3-VL encoders; else 0)."""
        return len(getattr(self.encoder, "deepstack_layers", ()))
    @property
    def media_kinds(self) -> tuple[str, ...]:  # type: ignore[override]  # per flavor: videos need a video token
        """What ``loongforge generate`` may give this model: images, and videos when it has a video token (a Qwen
        ViT encoder)."""
        return ("image",) if self.video_token_id is None else ("image", "video")

    @property
    def timestamped_videos(self) -> bool:
        """Whether videos reach the text frame group by frame group after timestamps (a Qwen3-VL encoder); see
        :mod:`loongforge_vlm.model.position_ids`."""
        return getattr(self.encoder, "timestamped_videos", False)

    @property
    def uses_mrope(self) -> bool:
        """Whether the backbone takes ``(3, batch, seq)`` multimodal position ids."""
        return self.foundation.mrope_section is not None

    @property
    def spatial_merge_size(self) -> int:
        """Side of the patch block that becomes one LLM token."""
        if isinstance(self.encoder, QwenViTFlavor):
            return self.encoder.spatial_merge_size
        return self.projector.merge  # type: ignore[union-attr]

    def with_overrides(self, **overrides: Any) -> VLMFlavor:
        """A copy with some fields replaced (``foundation=...`` swaps the backbone); unknown names are errors. A part
        may be a mapping, as a saved config holds it (:func:`~loongforge_vlm.model.parts.overridden_part`)."""
        from loongforge_vlm.model.parts import overridden_part

        parts = {role: overridden_part(role, overrides[role], getattr(self, role))
                 for role in PART_ROLES if role in overrides}
        return replace_fields(self, {**overrides, **parts}, what="vlm flavor")

    def with_parts(self, parts: dict[str, Any], *, registry: Any, where: str) -> VLMFlavor:
        """A copy with config parts (``model.encoder/projector/foundation``) replaced, see
        :mod:`loongforge_vlm.model.parts`."""
        from loongforge_vlm.model.parts import compose_parts

        return compose_parts(self, parts, registry=registry, where=where, defaults={})

    # -- the model-family contract (loongforge.models.family) -------------------------------------------------

    @property
    def family_name(self) -> str:
        return "vlm"

    @property
    def decoder(self) -> DecoderFlavor:
        """The language backbone: what megatron splits and the layout checks and planner size."""
        return self.foundation

    def build_chunk(self, build: Any) -> Any:
        """Core builds the backbone chunk (its embedding returning the whole sequence, so that vision features are
        written in before the sequence-parallel scatter, which ``VisionLanguageModel.embed`` does); the vision
        parts join it on the first stage, drawn from ``build.seed`` alone (the same on every rank and layout)."""
        from loongforge_vlm.model.vlm import compose_vlm

        language_model = build.decoder_chunk(self.foundation, scatter_embedding_sequence_parallel=False)
        return compose_vlm(self, language_model, seed=build.seed, params_dtype=build.params_dtype)

    def replay_batch(self, batch: dict[str, Any], generator: Any) -> dict[str, Any]:
        """The text with one small image in every sequence (:mod:`loongforge_vlm.model.replay`), so ``loongforge
        diff`` runs the vision tower too."""
        from loongforge_vlm.model.replay import replay_batch

        return replay_batch(self, batch, generator)

    def hf_adapter(self) -> Any:
        """The Hugging Face tensors and ``config.json`` of a flavor with a transformers counterpart
        (:mod:`loongforge_vlm.model.hf_adapter`), so core reads its directories (``generate``, ``diff``); ``None``
        for a composed one."""
        from loongforge_vlm.model.hf_adapter import ARCHITECTURES, LLAVA_LAYOUTS, VLMHFAdapter

        if self.hf_architecture not in (*ARCHITECTURES, *LLAVA_LAYOUTS):
            return None
        return VLMHFAdapter(self)

    def media_prompts(self, request: Any) -> Any:
        """Prompts with images and videos for ``loongforge generate --image/--video``
        (:mod:`loongforge_vlm.model.media_prompts`): the processor's pixels, the placeholders expanded with this
        model's token ids, M-RoPE positions and deltas."""
        from loongforge_vlm.model.media_prompts import media_prompts

        return media_prompts(self, request)

    def reference_implementation(self) -> Any:
        """transformers' own model of a flavor with a Hugging Face layout (Qwen2-VL, Qwen2.5-VL), for ``loongforge
        diff --reference`` (:mod:`loongforge_vlm.model.reference`); ``None`` for a composed one."""
        from loongforge_vlm.model.hf_interop import ARCHITECTURES

        if self.hf_architecture not in ARCHITECTURES:
            return None
        from loongforge_vlm.model.reference import TransformersVLM

        return TransformersVLM(self)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """Encoder, projector and language backbone (:func:`num_params`)."""
        return num_params(self, include_embeddings=include_embeddings)

    def parameter_groups(self) -> tuple[Any, ...]:
        """One group per part with its :attr:`part_options`: the projector first (a Qwen ViT's patch merger lives
        inside the encoder module, ``encoder.merger``), then the encoder, then the language backbone."""
        projector = ("encoder.merger.*",) if isinstance(self.encoder, QwenViTFlavor) else ("projector.*",)
        roles = {"projector": projector, "encoder": ("encoder.*",), "foundation": ("language_model.*",)}
        return parameter_groups(roles, self.part_options)

    def check_layout(self, layout: Any) -> list[Any]:
        """The backbone's problems, an encoder tp the layout cannot take (:func:`encoder_tp_problem`), plus what
        DeepStack cannot take: its features exist on the first pipeline stage only and are laid out over the whole
        sequence (:mod:`loongforge_vlm.model.deepstack`)."""
        from loongforge.models.sizing import LayoutProblem

        problems = self.foundation.check_layout(layout)
        problem = encoder_tp_problem(self, layout.tp)
        if problem:
            problems.append(LayoutProblem(problem, reason="model.encoder.tp must be 1 or parallel.tp"))
        if self.deepstack_levels and (layout.pp > 1 or layout.cp > 1):
            problems.append(LayoutProblem(f"Qwen3-VL's DeepStack runs with pp=1 and cp=1 (got pp={layout.pp}, "
                                          f"cp={layout.cp}); split it with tp/sequence parallelism or dp",
                                          reason="DeepStack needs pp=1 and cp=1"))
        return problems

    def planner_parts(self, config: Any) -> tuple[Any, ...]:
        """The vision encoder + projector as the layout planner's first-stage part, sized for
        :attr:`vision_tokens_per_sample`; see :mod:`loongforge_vlm.model.planner_parts`."""
        from loongforge_vlm.model.planner_parts import vision_parts

        return vision_parts(self, config)


def encoder_tp_problem(flavor: VLMFlavor, tp: int) -> str | None:
    """Why ``model.encoder.tp`` cannot run beside a decoder at ``tp`` (``None``: it can). The encoder reuses the
    decoder's TP group, so its tp is 1 or the decoder's; at ``tp`` 1 the encoder is whole whatever it says, so the
    commands that rebuild a model in one process (``convert``, ``eval``) read a checkpoint trained at encoder tp 2.
    Only the Qwen ViT has tensor-parallel blocks."""
    size = flavor.encoder_options.tp
    if size == 1:
        return None
    if not isinstance(flavor.encoder, QwenViTFlavor):
        return f"model.encoder.tp={size}: only a Qwen ViT encoder splits over tensor-parallel ranks (set it to 1)"
    if tp == 1:
        return None
    if size != tp:
        return (f"model.encoder.tp={size} must be 1 or parallel.tp ({tp}): the encoder splits over the decoder's "
                "tensor-parallel group")
    heads, ffn = flavor.encoder.num_heads, flavor.encoder.ffn_dim
    if heads % size or ffn % size:
        return f"model.encoder.tp={size} must divide the encoder's {heads} attention heads and MLP width {ffn}"
    return None


def projector_shapes(flavor: VLMFlavor) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the separate projector (empty when the encoder ends in its own)."""
    if flavor.projector is None:
        return {}
    merged = flavor.encoder.dim * flavor.projector.merge ** 2
    hidden = flavor.projector.hidden_dim or flavor.foundation.hidden_size
    width = flavor.foundation.hidden_size
    norm = {"norm.weight": (merged,), "norm.bias": (merged,)} if flavor.projector.norm else {}
    newline = {"newline": (width,)} if isinstance(flavor.encoder, SiglipFlavor) and flavor.encoder.anyres else {}
    return {**norm, "fc1.weight": (hidden, merged), "fc1.bias": (hidden,), "fc2.weight": (width, hidden),
            "fc2.bias": (width,), **newline}


def num_params(flavor: VLMFlavor, *, include_embeddings: bool = True) -> int:
    """Parameter count with the unpadded vocabulary (as published sizes and transformers count it);
    ``include_embeddings=False`` leaves out the backbone's token embeddings and output layer."""
    encoder = flavor.encoder
    if isinstance(encoder, QwenViTFlavor):
        vision = qwen_vit_num_params(encoder)
    elif isinstance(encoder, InternViTFlavor):
        vision = internvit_num_params(encoder)
    else:
        vision = siglip_num_params(encoder)
    projector = count_of_shapes(projector_shapes(flavor))
    return vision + projector + flavor.foundation.num_params(include_embeddings=include_embeddings)


_QWEN_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653)
_MROPE = (16, 24, 24)  # head_dim 128


def _qwen2_text(**kw: Any) -> DecoderFlavor:
    base = dict(family="qwen2", rope_theta=1000000.0, norm_eps=1e-6, add_qkv_bias=True, mrope_section=_MROPE,
                hf_architecture="Qwen2ForCausalLM")
    return DecoderFlavor(**{**base, **kw})


def _qwen2_vl(encoder: str, text: DecoderFlavor) -> VLMFlavor:
    return VLMFlavor(encoder=QWEN_VIT_FLAVORS[encoder], foundation=text,
                     hf_architecture="Qwen2VLForConditionalGeneration", **_QWEN_TOKENS)


def _qwen25_vl(encoder: str, text: DecoderFlavor) -> VLMFlavor:
    return VLMFlavor(encoder=QWEN_VIT_FLAVORS[encoder], foundation=text, tokens_per_second=2,
                     hf_architecture="Qwen2_5_VLForConditionalGeneration", **_QWEN_TOKENS)


def _qwen3_text(**kw: Any) -> DecoderFlavor:
    base = dict(family="qwen3", rope_theta=5000000.0, norm_eps=1e-6, qk_layernorm=True,
                vocab_size=151936, max_position_embeddings=262144, mrope_section=(24, 20, 20),
                mrope_interleaved=True, hf_architecture="Qwen3ForCausalLM")
    return DecoderFlavor(**{**base, **kw})


def _qwen3_moe_text(**kw: Any) -> DecoderFlavor:
    """A Qwen3-MoE decoder as Qwen3-VL-MoE runs it: every layer routed, the chosen softmax probabilities always
    renormalised (transformers' ``Qwen3VLMoeTextTopKRouter`` has no ``norm_topk_prob`` switch), the published
    ``router_aux_loss_coef``."""
    base = dict(family="qwen3-moe", moe_router_topk=8, num_experts=128, head_dim=128, moe_aux_loss_coeff=0.001,
                moe_norm_topk_prob=True, hf_architecture="Qwen3MoeForCausalLM")
    return _qwen3_text(**{**base, **kw})


def _qwen3_vl(encoder: str, text: DecoderFlavor) -> VLMFlavor:
    architecture = "Qwen3VLMoeForConditionalGeneration" if text.num_experts else "Qwen3VLForConditionalGeneration"
    return VLMFlavor(encoder=QWEN_VIT_FLAVORS[encoder], foundation=text, hf_architecture=architecture, **_QWEN_TOKENS)


#: InternVL's image-context, ``<img>`` and ``</img>`` token ids (its tokenizer's added tokens).
INTERNVL_TOKENS = dict(image_token_id=151667, vision_start_token_id=151665, vision_end_token_id=151666)


def _internvl3_text(**kw: Any) -> DecoderFlavor:
    """A Qwen2.5 decoder as InternVL3 ships it: plain RoPE, InternVL's vocabulary, an untied output layer."""
    return _qwen2_text(**{"mrope_section": None, "vocab_size": 151674, "max_position_embeddings": 32768, **kw})


def _internvl(tower: str, text: DecoderFlavor, **tokens: int) -> VLMFlavor:
    """InternViT -> 2x2 pixel shuffle -> LayerNorm -> ``Linear -> GELU -> Linear`` (at the text width) -> ``text``."""
    return VLMFlavor(encoder=INTERNVIT_FLAVORS[tower], projector=MlpProjectorFlavor(merge=2, norm=True),
                     foundation=text, hf_architecture="InternVLForConditionalGeneration",
                     **{**INTERNVL_TOKENS, **tokens})


#: A tiny Qwen2 text model for the Qwen VLM tiny flavors (4 heads in 2 query groups, so it splits over 2 TP
#: ranks): head_dim 12 with an asymmetric M-RoPE split and a
#: small rope_theta (every frequency turns noticeably over a short sequence), so a mixed-up section order
#: changes the logits. The vocabulary (384, a multiple of megatron's padding, so no
#: padded logits enter the loss) ends in the four vision token ids.
_TINY_TEXT = dict(num_layers=2, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                  vocab_size=384, max_position_embeddings=1024, mrope_section=(1, 2, 3), rope_theta=100.0)
_TINY_TOKENS = dict(image_token_id=380, video_token_id=381, vision_start_token_id=382, vision_end_token_id=383)

FLAVORS: dict[str, VLMFlavor] = {
    "qwen2-vl-tiny": VLMFlavor(encoder=QWEN_VIT_FLAVORS["qwen2-vl-vit-tiny"], foundation=_qwen2_text(**_TINY_TEXT),
                               hf_architecture="Qwen2VLForConditionalGeneration", **_TINY_TOKENS),
    "qwen2.5-vl-tiny": VLMFlavor(encoder=QWEN_VIT_FLAVORS["qwen2.5-vl-vit-tiny"],
                                 foundation=_qwen2_text(**_TINY_TEXT, tie_word_embeddings=True),
                                 tokens_per_second=2, hf_architecture="Qwen2_5_VLForConditionalGeneration",
                                 **_TINY_TOKENS),
    "qwen2-vl-2b": _qwen2_vl("qwen2-vl-2b-vit", _qwen2_text(
        num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2,
        vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)),
    "qwen2-vl-7b": _qwen2_vl("qwen2-vl-7b-vit", _qwen2_text(
        num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
        vocab_size=152064, max_position_embeddings=32768)),
    "qwen2.5-vl-3b": _qwen25_vl("qwen2.5-vl-3b-vit", _qwen2_text(
        num_layers=36, hidden_size=2048, ffn_hidden_size=11008, num_attention_heads=16, num_query_groups=2,
        vocab_size=151936, max_position_embeddings=128000, tie_word_embeddings=True)),
    "qwen2.5-vl-7b": _qwen25_vl("qwen2.5-vl-7b-vit", _qwen2_text(
        num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
        vocab_size=152064, max_position_embeddings=128000)),
    # Qwen3-VL-tiny: the qwen3-vl ViT (DeepStack into decoder layers 0 and 1 of 3) before a Qwen3 decoder with
    # QK-norm, head_dim 16 != 48 / 4, interleaved M-RoPE over (4, 2, 2) frequencies and rope_theta 100.
    "qwen3-vl-tiny": VLMFlavor(encoder=QWEN_VIT_FLAVORS["qwen3-vl-vit-tiny"], foundation=_qwen3_text(
        num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, head_dim=16,
        vocab_size=384, max_position_embeddings=1024, mrope_section=(4, 2, 2), rope_theta=100.0),
        hf_architecture="Qwen3VLForConditionalGeneration", **_TINY_TOKENS),
    # Qwen3-VL-MoE-tiny: the same tower and attention before Qwen3-MoE layers of 6 experts, 2 routed per token, each
    # 40 wide (2 * 40 != 48, so a gate_up_proj stored [E, H, 2I] cannot pass for the in-memory [E, 2I, H]).
    "qwen3-vl-moe-tiny": VLMFlavor(encoder=QWEN_VIT_FLAVORS["qwen3-vl-vit-tiny"], foundation=_qwen3_moe_text(
        num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, head_dim=16,
        vocab_size=384, max_position_embeddings=1024, mrope_section=(4, 2, 2), rope_theta=100.0, num_experts=6,
        moe_router_topk=2, moe_ffn_hidden_size=40),
        hf_architecture="Qwen3VLMoeForConditionalGeneration", **_TINY_TOKENS),
    # The published Qwen/Qwen3-VL-*-Instruct config.json values (text_config and vision_config).
    "qwen3-vl-2b": _qwen3_vl("qwen3-vl-2b-vit", _qwen3_text(
        num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8,
        tie_word_embeddings=True)),
    "qwen3-vl-8b": _qwen3_vl("qwen3-vl-8b-vit", _qwen3_text(
        num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8)),
    "qwen3-vl-30b-a3b": _qwen3_vl("qwen3-vl-30b-a3b-vit", _qwen3_moe_text(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, moe_ffn_hidden_size=768, num_attention_heads=32,
        num_query_groups=4)),
    "qwen3-vl-235b-a22b": _qwen3_vl("qwen3-vl-235b-a22b-vit", _qwen3_moe_text(
        num_layers=94, hidden_size=4096, ffn_hidden_size=12288, moe_ffn_hidden_size=1536, num_attention_heads=64,
        num_query_groups=4)),
    # SigLIP-tiny (32px images, 8x8 patches) -> 2x2-merging MLP -> llama-debug: 16 tokens per image, plain RoPE.
    # Ids 259..261 follow the byte tokenizer's 259 tokens.
    "vlm-tiny": VLMFlavor(encoder=SIGLIP_FLAVORS["siglip-tiny"], projector=MlpProjectorFlavor(merge=2),
                          foundation=LLAMA_FLAVORS["llama-debug"], image_token_id=259, vision_start_token_id=260,
                          vision_end_token_id=261),
    # internvit-tiny (16px tiles) -> pixel shuffle -> the tiny Qwen2 decoder with plain RoPE: 4 tokens a tile. The
    # byte-vision tokenizer's ids (259..261), so it trains on the shapes set as it stands.
    "internvl-tiny": _internvl("internvit-tiny", _qwen2_text(**{**_TINY_TEXT, "mrope_section": None}),
                               image_token_id=259, vision_start_token_id=260, vision_end_token_id=261),
    # The published OpenGVLab/InternVL3-{1B,2B,8B}-hf config.json values: InternViT-300M in front of the Qwen2.5
    # 0.5B / 1.5B / 7B decoders with InternVL's 151674-token vocabulary and untied output layers.
    "internvl3-1b": _internvl("internvit-300m", _internvl3_text(num_layers=24, hidden_size=896, ffn_hidden_size=4864,
                                                                num_attention_heads=14, num_query_groups=2)),
    "internvl3-2b": _internvl("internvit-300m", _internvl3_text(num_layers=28, hidden_size=1536, ffn_hidden_size=8960,
                                                                num_attention_heads=12, num_query_groups=2)),
    "internvl3-8b": _internvl("internvit-300m", _internvl3_text(num_layers=28, hidden_size=3584,
                                                                ffn_hidden_size=18944, num_attention_heads=28,
                                                                num_query_groups=4)),
}

#: Hugging Face ids of the real flavors (registered as aliases: they name the whole VLM).
HF_IDS: dict[str, tuple[str, ...]] = {
    "qwen2-vl-2b": ("Qwen/Qwen2-VL-2B-Instruct",),
    "qwen2-vl-7b": ("Qwen/Qwen2-VL-7B-Instruct",),
    "qwen2.5-vl-3b": ("Qwen/Qwen2.5-VL-3B-Instruct",),
    "qwen2.5-vl-7b": ("Qwen/Qwen2.5-VL-7B-Instruct",),
    "qwen3-vl-2b": ("Qwen/Qwen3-VL-2B-Instruct",),
    "qwen3-vl-8b": ("Qwen/Qwen3-VL-8B-Instruct",),
    "qwen3-vl-30b-a3b": ("Qwen/Qwen3-VL-30B-A3B-Instruct",),
    "qwen3-vl-235b-a22b": ("Qwen/Qwen3-VL-235B-A22B-Instruct",),
    "internvl3-1b": ("OpenGVLab/InternVL3-1B-hf",),
    "internvl3-2b": ("OpenGVLab/InternVL3-2B-hf",),
    "internvl3-8b": ("OpenGVLab/InternVL3-8B-hf",),
}


def describe(flavor: VLMFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = size_label(count)
    encoder = flavor.encoder
    if isinstance(encoder, QwenViTFlavor):
        vision = f"{QWEN_VIT_TITLES[encoder.family]} ViT + patch merger"
    elif isinstance(encoder, InternViTFlavor):
        vision = f"InternViT ({encoder.image_size}px tiles) + pixel-shuffle LN-MLP projector"
    else:
        vision = f"SigLIP + {flavor.projector.merge}x{flavor.projector.merge} MLP projector"  # type: ignore[union-attr]
        vision += ", AnyRes tiling" if encoder.anyres else ""
    text = flavor.foundation
    positions = f"M-RoPE {list(text.mrope_section)}" if text.mrope_section else "1D RoPE"
    if text.mrope_interleaved:
        positions = f"interleaved {positions}"
    if flavor.deepstack_levels:
        positions += f", DeepStack into the first {flavor.deepstack_levels} layers"
    return (f"vision-language model, {size} params: {vision} ({encoder.num_layers} layers, d{encoder.dim}) -> "
            f"{text.family} decoder ({text.num_layers} layers, d{text.hidden_size}), {positions}")
