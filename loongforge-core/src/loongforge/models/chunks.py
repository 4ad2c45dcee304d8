"""The one builder: every command that needs megatron model chunks gets them here, through the family's
:meth:`~loongforge.models.family.ModelFamily.build_chunk`.

Why one builder: ``train``, ``generate``, ``convert``, the planner's measurement and the plugins' evaluate /
convert commands used to build models each their own way, so a composed model (a VLM) trained fine but crashed
in ``generate``, which called core's decoder builder directly. Now each caller describes *where* a chunk goes
(:class:`ChunkBuild`: device backend, dtype, parallel layout, pipeline position, seed) and the family decides
*what* it is. :func:`build_model_chunks` is the training run's entry (one chunk per virtual pipeline stage this
rank holds); :func:`build_standalone` the one-process entry of conversion and generation (TP=PP=1, weights
loaded right after).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loongforge.models.decoder_model import DecoderSpec, ParallelSettings, build_model
from loongforge.models.family import ModelFamily

if TYPE_CHECKING:
    from loongforge.config.schema import LoongForgeConfig
    from loongforge.models.flavor import DecoderFlavor

__all__ = ["ChunkBuild", "DecoderSpec", "build_model_chunks", "build_standalone"]


@dataclass(frozen=True)
class ChunkBuild:
    """Where one model chunk goes; what :meth:`ModelFamily.build_chunk` receives.

    ``backend`` is the device backend: its ``spec_provider()`` supplies the layer modules, so a family that
    builds through :meth:`decoder_chunk` (or passes the provider to megatron's spec functions) runs on every
    device plugin. ``pre_process`` / ``post_process`` say whether this chunk holds the embedding / the output
    layer; ``vp_stage`` is its virtual pipeline stage (``None`` without virtual stages). ``extra_config`` is
    what the device and the run add to megatron's ``TransformerConfig`` (precision recipe, recompute, per-token
    loss). ``seed`` draws weights that do not depend on the layout (:mod:`loongforge.parallel.init`); ``None``
    when the caller loads weights right after building (conversion, generation), so none are drawn.
    """

    backend: Any
    params_dtype: str = "fp32"
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    pre_process: bool = True
    post_process: bool = True
    vp_stage: int | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = 0

    def decoder_chunk(self, flavor: DecoderFlavor, spec: DecoderSpec | None = None, **options: Any) -> Any:
        """Core's megatron ``GPTModel`` chunk of ``flavor`` for this build, weights drawn from :attr:`seed`.

        What an LLM family builds and what a composed model wraps (a VLM's language backbone). The layers are
        ``spec`` (a :class:`~loongforge.models.decoder_model.DecoderSpec`: per-layer specs, a ``TransformerConfig``
        subclass, an MTP block), by default the flavor's own (``flavor.decoder_spec()``), so that a decoder with its
        own layers is built the same way as a foundation as by itself; ``options`` go to
        :func:`loongforge.models.decoder_model.build_model` (``scatter_embedding_sequence_parallel=False`` for a model
        that edits the embedding's output before the sequence-parallel scatter).
        """
        from loongforge.parallel.init import initialize_layout_independent

        if spec is None:
            spec = flavor.decoder_spec()
        chunk = build_model(
            flavor, spec=spec, backend=self.backend, params_dtype=self.params_dtype,
            extra_config=dict(self.extra_config),
            pre_process=self.pre_process, post_process=self.post_process, parallel=self.parallel,
            vp_stage=self.vp_stage, **options,
        )
        if self.seed is not None:
            initialize_layout_independent([chunk], self.seed)
        return chunk


def build_model_chunks(family: ModelFamily, config: LoongForgeConfig, backend: Any, layout: Any,
                       settings: Any) -> list[Any]:
    """This rank's model chunks for a training run, one per (virtual) pipeline stage it holds.

    ``layout`` is the megatron strategy's validated layout, ``settings`` the device's megatron settings
    (``DeviceBackend.megatron_settings``). megatron says which stage holds the embedding and the output layer;
    with virtual stages only the first chunk of the first rank and the last chunk of the last rank do.
    Megatron's parallel state must be initialised for ``layout``.
    """
    from megatron.core import parallel_state

    from loongforge.models.lora import base_params_dtype
    from loongforge.models.recompute import recompute_kwargs
    from loongforge.parallel.moe_overlap_check import EXPERT_CHUNKS, megatron_overlap_kwargs, moe_a2a_overlap_mode

    parallel = ParallelSettings(
        tp=layout.tp, pp=layout.pp, sequence_parallel=layout.sequence_parallel, vpp=layout.vpp,
        ep=layout.ep, etp=layout.etp, moe_dispatcher=layout.moe_dispatcher, cp=layout.cp,
        cp_comm_type=layout.cp_comm_type, cp_a2a_size=layout.cp_a2a_size,
    )
    decoder = family.decoder
    if decoder is None:
        raise ValueError(f"model {family.family_name} has no megatron decoder to build")  # engine "task": caller bug
    layers_per_stage = decoder.num_layers // (layout.pp * layout.num_chunks)
    extra_config = {
        **settings.transformer_config_kwargs(),
        **recompute_kwargs(config.model.recompute, layers_per_stage, config.source),
        **megatron_overlap_kwargs(layout, backend),
    }
    if config.training.loss_normalization == "global_tokens":  # the schedule and DDP divide by the global count
        extra_config["calculate_per_token_loss"] = True
    params_dtype = base_params_dtype(config.model.lora, settings.params_dtype)  # model.lora.base_dtype: bf16 base
    chunks = []
    for index in range(layout.num_chunks):
        vp_stage = index if layout.vpp else None
        build = ChunkBuild(
            backend=backend, params_dtype=params_dtype, parallel=parallel, extra_config=extra_config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, seed=config.run.seed,
        )
        chunks.append(family.build_chunk(build))
    if moe_a2a_overlap_mode(layout, backend) == EXPERT_CHUNKS:
        from loongforge.parallel.moe_overlap import install_expert_chunked_overlap

        install_expert_chunked_overlap(chunks)
    return chunks


def build_standalone(family: ModelFamily, backend: Any, params_dtype: str = "fp32", *,
                     seed: int | None = None) -> Any:
    """The whole model as one chunk at TP=PP=1 (conversion, generation, tests), inside a one-process megatron
    world (:func:`loongforge.interop.world.standalone_world`). ``seed=None``: the caller loads weights next."""
    return family.build_chunk(ChunkBuild(backend=backend, params_dtype=params_dtype, seed=seed))

