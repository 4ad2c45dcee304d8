"""The model-family contract: the one type every registered model object (a *flavor*) implements.

Why one declared base class: core used to probe registered objects for undeclared attributes (``make_task``,
``compose``, ``foundation`` ...), so a family author had to read core's code to learn what it looks for, and a
misspelt method was silently skipped. Here every slot core may call is declared once, typed and documented, with
a default that says what "not supplied" means -- the way megatron-core's ``BackendSpecProvider`` grows through
optional methods. Core checks ``isinstance(obj, ModelFamily)`` when it resolves a model name and never asks an
object for anything not declared here.

A flavor is usually a frozen dataclass deriving from this class (``DecoderFlavor`` for megatron decoders, the
plugins' DiT / policy / VLM flavors). This module stays torch-free: flavors are registered and listed without
importing torch; the heavy slots import what they need when called.

Two step engines train models (:mod:`loongforge.train.loop`): ``megatron`` (decoder chunks under megatron-core's
schedules and optimizer; the flavor supplies :meth:`ModelFamily.build_chunk`) and ``task`` (a plain torch module
under the torch-native strategies; the flavor supplies :meth:`ModelFamily.make_task`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from loongforge.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Collection
    from pathlib import Path

    from loongforge.config.schema import LoongForgeConfig
    from loongforge.models.chunks import ChunkBuild
    from loongforge.models.flavor import DecoderFlavor
    from loongforge.models.media import MediaPrompts, MediaRequest
    from loongforge.models.parameter_groups import ParameterGroup
    from loongforge.models.sizing import DecoderTerms, LayoutProblem
    from loongforge.models.task_terms import TaskTerms
    from loongforge.parallel.megatron import Layout
    from loongforge.registry import Registry

#: The step engines a family can name in :attr:`ModelFamily.engine`.
ENGINES: tuple[str, ...] = ("megatron", "task")


class HFAdapter(Protocol):
    """What :meth:`ModelFamily.hf_adapter` returns: one model's Hugging Face layout, both ways.

    State dicts are *full* (TP=PP=1) megatron state dicts as :func:`loongforge.interop.sharding.gather_full_state`
    returns them from the chunk :meth:`ModelFamily.build_chunk` builds, and Hugging Face tensors as
    ``save_pretrained`` writes them. Core's decoder families use :class:`loongforge.models.decoder_hf.DecoderHFAdapter`.
    """

    def config_json(self, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``config.json`` mapping for weights in ``dtype`` (fp32/bf16/fp16); ``base`` is the source
        checkpoint's own ``config.json`` (its keys this model does not own are kept), or ``None``."""

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face tensors from a full megatron state dict."""

    def from_hf(self, tensors: dict[str, Any], *, padded_vocab_size: int | None = None) -> dict[str, Any]:
        """A full megatron state dict from Hugging Face tensors (in memory or as stored on disk), vocabulary rows
        padded to ``padded_vocab_size`` (what the layout's embedding holds; ``None``: the TP=1 model's)."""

    def tensor_shapes(self, stored: Collection[str]) -> dict[str, tuple[int, ...] | None]:
        """Every tensor a checkpoint of this model holds, by the name it is stored under, with its shape.

        ``stored`` are the names a checkpoint directory holds, so the adapter can tell its storage variants apart
        (experts fused or one module per expert, a base-model prefix some files omit). ``None`` as a shape: the
        tensor may be present and is ignored (a tied model's ``lm_head.weight``). Core checks a directory against
        this before reading any weight: a missing, unexpected or misshapen tensor fails naming the tensor and file.
        """


@dataclass(frozen=True)
class ModulePair:
    """One module of a LoongForge model and the module of its reference implementation that computes the same
    tensor (``decoder.layers.3.mlp`` and transformers' ``model.layers.3.mlp``): how ``loongforge diff --reference``
    compares two implementations module by module. Only modules whose outputs mean the same thing are paired (a
    fused QKV projection has no counterpart in a model with three).

    ``seq_first``: our output is ``[sequence, batch, ...]`` (megatron's layout) where the reference's is
    ``[batch, sequence, ...]``. ``width``: only the first ``width`` entries of our output's last dimension count
    (megatron's padded vocabulary), ``None`` for all.
    """

    ours: str
    theirs: str
    seq_first: bool = False
    width: int | None = None


def module_pairs_from_parameters(names: Mapping[str, Sequence[str]], *, seq_first: bool = False
                                 ) -> tuple[ModulePair, ...]:
    """Module pairs read off a conversion's parameter-name map (ours -> the reference's, several names where our
    tensor is their concatenation): a parameter that is one reference parameter of the same kind
    (``X.weight`` -> ``Y.weight``) pairs module ``X`` with ``Y``; fused ones pair nothing. How a family whose
    modules are the reference's, renamed, declares its pairs without listing them twice."""
    pairs: dict[str, ModulePair] = {}
    for ours, theirs in names.items():
        kind = ours.rpartition(".")[2]
        if len(theirs) == 1 and "." in ours and theirs[0].rpartition(".")[2] == kind:
            module = ours.rpartition(".")[0]
            pairs.setdefault(module, ModulePair(module, theirs[0].rpartition(".")[0], seq_first=seq_first))
    return tuple(pairs.values())


class ReferenceImplementation(Protocol):
    """What :meth:`ModelFamily.reference_implementation` returns: the family's own implementation in the library
    its Hugging Face format comes from (transformers' ``*ForCausalLM`` for core's decoders), so ``loongforge diff
    --reference`` can run a Hugging Face directory there and name the first module where LoongForge's model of it
    computes differently -- where a conversion or a kernel went wrong, not just that the logits differ.
    """

    #: The library's import name, for messages and reports (``transformers``, ``diffusers``, ``lerobot``).
    library: str

    def load(self, path: Path) -> Any:
        """The reference model of the Hugging Face directory ``path``, in fp32 on the CPU, in training mode with
        nothing random (dropout off), its parameters requiring gradients."""

    def avoided_tokens(self, path: Path) -> tuple[int, ...]:
        """Token ids the replayed batch must not hold because the reference treats them specially (the padding id,
        whose embedding row transformers' ``nn.Embedding(padding_idx=...)`` gives no gradient)."""

    def loss(self, model: Any, batch: Mapping[str, Any]) -> Any:
        """The scalar loss of ``model`` on ``batch``, the quantity LoongForge's side is traced with, so gradients
        compare too. A decoder's batch: ``tokens``, ``position_ids`` and ``labels`` ``[batch, sequence]`` (mean
        next-token cross-entropy). A task model's: ``task``, ``batch`` and ``generators``, what
        :meth:`loongforge.tasks.Task.validation_loss` takes (the reference model run through the task's own loss,
        every random draw from the same seeded generators as LoongForge's side)."""

    def module_pairs(self) -> Sequence[ModulePair]:
        """Our modules and the reference's that compute the same output, in any order (outputs are compared in the
        order our forward pass computed them)."""

    def parameters(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Tensors of our full (TP=PP=1) state dict under the reference model's own parameter names (as
        ``named_parameters`` gives them in memory). Used for values and for gradients alike, which the
        conversion's reshapes and slices map the same way."""


class HFReader(Protocol):
    """What a plugin registers under a Hugging Face architecture (``loongforge_register_hf_architectures``): the
    reader of that architecture's ``config.json``.

    Every command that crosses from Hugging Face (``model.load: hf:DIR``, ``loongforge convert hf-to-mcore``,
    ``loongforge check``) finds the reader by ``config.json``'s ``architectures[0]`` (or, without one, its
    ``model_type``, registered as an alias), asks it for the model, then uses that model's
    :meth:`ModelFamily.hf_adapter` for the tensors. Core's decoder families register through the same hook.
    """

    def read_config(self, raw: dict[str, Any], path: Path) -> ModelFamily:
        """The model ``raw`` (the parsed ``config.json`` at ``path``) describes: a flavor whose ``hf_adapter()``
        reads the directory's tensors. What the family cannot express (a switch it does not implement) raises a
        one-line :class:`~loongforge.errors.LoongForgeError` naming ``path`` and the key."""


class ModelFamily:
    """Base of every registered model object; subclasses override the slots that apply to them."""

    #: Which step engine trains this model: ``"megatron"`` or ``"task"`` (see :data:`ENGINES`).
    engine: ClassVar[str] = "megatron"
    #: Batch keys the megatron model's forward takes beside ``tokens``, ``position_ids``, ``attention_mask`` and
    #: ``labels`` (a VLM's ``pixel_values`` ...); the megatron engine passes these through from each batch.
    extra_inputs: ClassVar[tuple[str, ...]] = ()
    #: Roles of the parts a config may set for a composed model (``model: {<role>: <name or mapping>}``), e.g. a
    #: VLM's encoder / projector / foundation. Empty: the model is not composed of parts.
    part_roles: ClassVar[tuple[str, ...]] = ()
    #: The dataclass of this model's ``task:`` config section (task engine), validated by core like its own
    #: sections (unknown keys, types, each number's declared range -- ``loongforge.config.sections.ranged``, which
    #: the family suite requires of every number --, every float finite). ``None``: the model takes no ``task:``
    #: options.
    task_options: ClassVar[type | None] = None
    #: Whether a config that sets only parts (``model: {encoder: ..., foundation: ...}`` without ``name``)
    #: composes this model; the one registered family with this set and :attr:`part_roles` covering the given
    #: roles is chosen (a VLM plugin's bare ``vlm`` composition).
    default_composition: ClassVar[bool] = False
    #: Kinds of media file generation can give this model beside its text (``loongforge generate --image PATH``
    #: gives kind ``"image"``), read by :meth:`media_prompts`. Empty: text only, and a file of any kind is refused
    #: in one line naming the model.
    media_kinds: ClassVar[tuple[str, ...]] = ()

    @property
    def family_name(self) -> str:
        """A short name for messages (``llama``, ``wan`` ...); defaults to the class name."""
        return type(self).__name__

    def with_overrides(self, **overrides: Any) -> ModelFamily:
        """A copy with some fields replaced (``model.overrides``); an unknown field is a :class:`ConfigError`."""
        from loongforge.models.flavor import replace_fields

        return replace_fields(self, overrides, what=f"{self.family_name} flavor")

    def with_parts(self, parts: dict[str, Any], *, registry: Registry, where: str) -> ModelFamily:
        """This model with the config's parts (roles from :attr:`part_roles`) replaced or composed."""
        raise ConfigError(f"{where}: model.{'/'.join(parts)} set, but this {self.family_name} model is not composed "
                          "of parts (`loongforge list models`)")

    @property
    def decoder(self) -> DecoderFlavor | None:
        """The megatron decoder this model trains (itself for an LLM, a VLM's language backbone); ``None`` for
        task-engine models. What the planner, the FLOP counts and the layout checks need from it they ask through
        :meth:`decoder_terms`, :meth:`flops_per_token` and :meth:`check_layout`, whose defaults ask this decoder."""
        return None

    def build_chunk(self, build: ChunkBuild) -> Any:
        """Megatron engine: one model chunk (a ``torch.nn.Module``) for the pipeline stage ``build`` describes.

        ``build`` is a :class:`loongforge.models.chunks.ChunkBuild`: the device backend (its
        ``spec_provider()`` supplies the layer modules), dtype, parallel settings, pre/post-process flags, the
        virtual stage, the device's extra megatron config and the seed. Every command builds through here
        (:func:`loongforge.models.chunks.build_model_chunks` for training, ``build_standalone`` for conversion
        and generation), so layers must come from ``build.backend.spec_provider()`` and weights from
        ``build.seed`` alone; ``build.decoder_chunk(flavor)`` builds core's decoder that way. The
        ModelFamilySuite (:mod:`loongforge.testing.family_suite`) fails a family that does otherwise.
        """
        raise ConfigError(f"model {self.family_name} is trained by the {self.engine!r} engine and builds no "
                          "megatron chunks")

    def hf_adapter(self) -> HFAdapter | None:
        """The Hugging Face adapter (state-dict names and ``config.json`` both ways), or ``None`` when there is
        no Hugging Face counterpart (``loongforge convert`` then refuses in one line)."""
        return None

    def replay_batch(self, batch: dict[str, Any], generator: Any) -> dict[str, Any]:
        """The batch ``loongforge diff`` replays through this model, made from ``batch`` -- ``tokens``, ``labels``
        and ``position_ids`` ``[batch, sequence]`` of random text -- with draws from the torch ``generator``. A model
        that takes more than text returns it with its other inputs (keys of :attr:`extra_inputs`), so every part of
        the model computes and a fault in any part is named where it begins: a VLM places an image in each
        sequence. Default: ``batch`` unchanged."""
        return batch

    def reference_implementation(self) -> ReferenceImplementation | None:
        """This model in the library its Hugging Face format comes from (:class:`ReferenceImplementation`), for
        ``loongforge diff --reference``; ``None``: none is declared (the command then refuses in one line)."""
        return None

    def planner_parts(self, config: LoongForgeConfig) -> tuple[Any, ...]:
        """Memory/compute parts the planner adds outside the decoder (a VLM's vision encoder), sized for ``config``
        (:class:`loongforge.planner.memory.ComponentModel` objects); default none."""
        return ()

    def task_terms(self, config: LoongForgeConfig, sample_shape: tuple[int, ...] | None = None) -> TaskTerms | None:
        """Task engine: the model's parameters, FLOPs and activations for one training sample of ``config``
        (:class:`loongforge.models.task_terms.TaskTerms`), which ``loongforge plan`` splits over torch-native layouts
        (:mod:`loongforge.planner.task_planner`). ``sample_shape`` (``parallel.planner.sample_shape``, ``loongforge
        plan --sample-shape``) is one sample's shape in the family's own terms (a video's latent frames, height and
        width), for planning data that is not at hand; ``None``: the shape of the data ``config`` names. Raise a
        :class:`~loongforge.errors.ConfigError` when neither gives one. Default ``None``: the planner refuses the
        model in one line."""
        return None

    def num_params(self, *, include_embeddings: bool = True) -> int | None:
        """Parameters of the whole model with the unpadded vocabulary, as published sizes count them
        (``include_embeddings=False``: without the token embeddings and output layer). Default ``None``: not counted
        (a composed model's decoder alone would undercount it, so the default does not guess)."""
        return None

    def decoder_terms(self, kernels: str = "te") -> DecoderTerms | None:
        """Megatron engine: the decoder's parameters, activations and FLOPs by part and how layouts split them
        (:class:`loongforge.models.sizing.DecoderTerms`), which the layout planner (memory and time), ``loongforge
        plan`` and, through :meth:`flops_per_token`, the ``tflops``/``mfu`` metrics read. ``kernels`` is the
        activation profile (``"te"``: Transformer Engine's fused kernels; ``"local"``: megatron's local modules).
        Default: the :attr:`decoder`'s terms; ``None`` (no decoder): the planner refuses the model in one line."""
        decoder = self.decoder
        return decoder.decoder_terms(kernels) if decoder is not None and decoder is not self else None

    def flops_per_token(self, seq_length: int) -> float | None:
        """Training FLOPs (forward and backward, no recompute) per token of ``seq_length``-token sequences: what the
        ``tflops`` and ``mfu`` metrics divide by the step time (parts from :meth:`planner_parts` add their own).
        Default: from :meth:`decoder_terms`; ``None`` (no terms): the run reports no ``tflops``/``mfu``."""
        terms = self.decoder_terms()
        return terms.training_flops_per_token(seq_length) if terms is not None else None

    def check_layout(self, layout: Layout) -> list[LayoutProblem]:
        """Megatron engine: what a parallel ``layout`` (a :class:`loongforge.parallel.megatron.Layout`: tp, pp, vpp,
        cp, ep, etp, sequence parallelism) needs from this model -- heads, layers and experts it must divide, splits
        the model cannot take -- as :class:`loongforge.models.sizing.LayoutProblem` s; empty: it fits.
        ``loongforge check`` and ``train`` fail on the first, naming the config file; ``loongforge plan`` and
        ``parallel: auto`` never propose such a layout. Default: the :attr:`decoder`'s problems (none without one)."""
        decoder = self.decoder
        return decoder.check_layout(layout) if decoder is not None and decoder is not self else []

    def trained_parameters(self) -> tuple[str, ...]:
        """Megatron engine: ``fnmatch`` patterns of the only parameters (TP=1/PP=1 names) a training phase of this
        model trains -- the rest frozen before the optimizer exists, as ``model.freeze`` freezes (DeepSeek-V3.2's
        dense warm-up trains its indexers alone). Default ``()``: every parameter trains."""
        return ()

    def parameter_groups(self) -> tuple[ParameterGroup, ...]:
        """Named groups of parameters with their own learning rate, weight decay, freezing or start step
        (:class:`loongforge.models.parameter_groups.ParameterGroup`), which core applies when it builds the megatron
        engine's optimizer and schedule: a composed model's per-part options. Default ``()``: every parameter
        follows ``optimizer:``. (The task engine's single AdamW group does not read them yet.)"""
        return ()

    def media_prompts(self, request: MediaRequest) -> MediaPrompts:
        """Megatron engine: the prompts of ``request`` (:class:`loongforge.models.media.MediaRequest`) made ready
        for generation with its media files, each of a kind in :attr:`media_kinds`: token ids with the media
        placeholders expanded, the forward inputs that carry the files, and the positions of the prompts and of the
        tokens after them (:class:`loongforge.models.media.MediaPrompts`). Where the files go in the text is the
        family's choice (a placeholder the prompt holds, else before the text). An unreadable file raises a
        one-line :class:`~loongforge.errors.LoongForgeError` naming it. Core calls this only with kinds the family
        declares, so the default is never reached by a text-only model."""
        raise ConfigError(f"model {self.family_name} declares media kinds {self.media_kinds} but reads none")

    def check_task(self, config: LoongForgeConfig, options: Any) -> list[str]:
        """Task engine: the pre-flight of what the typed ``task:`` ``options`` name (a dataset, a checkpoint), run by
        ``loongforge check`` and ``train`` before anything is built; one summary line per thing checked. Open the
        data the way training will -- its header and one sample, held to the model (shapes, widths, cameras) -- and
        hold its sizes to a batch (:func:`loongforge.train.task_sizes.check_data_sizes`), so that nothing the task
        would trip over after the model is built passes. A problem raises a
        :class:`~loongforge.errors.LoongForgeError` naming the file (and sample). Default: nothing to check."""
        return []

    def make_task(self, config: LoongForgeConfig) -> Any:
        """Task engine: the :class:`loongforge.tasks.Task` that trains this model under ``config``."""
        raise ConfigError(f"{config.source}: model '{config.model.name}' is trained by the megatron engine and "
                          "takes no task: section")


def check_family(obj: Any, name: str, where: str) -> ModelFamily:
    """``obj`` if it implements the contract, else a one-line :class:`ConfigError` naming ``name`` and ``where``."""
    if not isinstance(obj, ModelFamily):
        raise ConfigError(f"{where}: '{name}' resolved to {type(obj).__name__}, which is not a "
                          "loongforge.models.family.ModelFamily: not a model to train by itself (a registered part "
                          "goes under a composed model's part role; see docs/plugin-authors.md)")
    if obj.engine not in ENGINES:
        raise ConfigError(f"{where}: model '{name}' names engine {obj.engine!r}; known: {', '.join(ENGINES)}")
    return obj

