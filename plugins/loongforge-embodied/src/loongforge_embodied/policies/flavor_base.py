"""What every policy flavor shares, whatever its architecture: size checks, image patches, overrides, the task.

Torch-free (flavors are registered at plugin load and listed by ``loongforge list``). A flavor is a frozen
dataclass that also derives from :class:`PolicyFlavor`, names itself in ``kind`` (error messages say
``"<kind> flavor: ..."``), lists its size fields in ``POSITIVE`` / ``NON_NEGATIVE`` and calls
:meth:`PolicyFlavor.check_sizes` from ``__post_init__``; it adds the protocol methods that differ between policies
(``build_policy``, ``frame_inputs``, ``flow_matching``, ``num_params``, ``describe``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.flavor import replace_fields

from loongforge_embodied.task_options import PolicyTaskOptions


class PolicyFlavor(ModelFamily):
    """Base of the policy flavor dataclasses (which must have ``image_size``, ``patch_size`` and ``cameras``): a
    model family of the task engine (``make_task`` is the policy task every flavor shares)."""

    engine: ClassVar[str] = "task"
    #: The ``task:`` section every policy's training takes (checked by core before the run).
    task_options: ClassVar[type | None] = PolicyTaskOptions
    kind: ClassVar[str] = "policy"
    POSITIVE: ClassVar[tuple[str, ...]] = ()
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("cameras",)

    def check_sizes(self) -> None:
        """One-line errors for sizes that cannot build a model."""
        for name in self.POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.kind} flavor: {name} must be positive, got {getattr(self, name)}")
        for name in self.NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.kind} flavor: {name} must be >= 0, got {getattr(self, name)}")
        if self.image_size <= 0 or self.patch_size <= 0 or self.image_size % self.patch_size:
            raise ConfigError(f"{self.kind} flavor: image_size {self.image_size} must be a positive multiple of "
                              f"patch_size {self.patch_size}")

    @property
    def patches(self) -> int:
        """Image tokens per camera."""
        return (self.image_size // self.patch_size) ** 2

    def inputs_summary(self) -> str:
        """What the policy observes, for ``describe``."""
        return f"{self.cameras} camera(s)" if self.cameras else "state only"

    @property
    def family_name(self) -> str:
        return self.kind

    def with_overrides(self, **overrides: Any) -> Any:
        return replace_fields(self, overrides, what=f"{self.kind} flavor")

    def check_dims(self, state_dim: int, action_dim: int, root: Any) -> None:
        """A one-line :class:`ConfigError` when the data's states or actions are wider than the flavor pads to."""
        for what, dim, most, field in (("actions", action_dim, self.max_action_dim, "max_action_dim"),
                                       ("observation.state", state_dim, self.max_state_dim, "max_state_dim")):
            if dim > most:
                raise ConfigError(f"{root}: {what} have {dim} dimensions, the flavor takes at most {most} "
                                  f"(raise model.overrides.{field})")

    def check_task(self, config: Any, options: PolicyTaskOptions) -> list[str]:
        """Pre-flight of ``loongforge check`` and ``train``: the data opened and held to the flavor as training will
        hold it (:func:`loongforge_embodied.preflight.check_policy_task`)."""
        from loongforge_embodied.preflight import check_policy_task

        return check_policy_task(self, config, options)

    def make_task(self, config: Any) -> Any:
        """What ``loongforge train`` runs for this flavor: the policy task every flavor shares (``train_task``)."""
        from loongforge_embodied.train_task import PolicyTask

        return PolicyTask(self, config)


class ActionTokenVocab:
    """Checks of a flavor whose vocabulary holds ``action_vocab`` action-token ids (Pi0-FAST's, or Pi0.5's FAST ids
    under knowledge insulation), for the tokenizer of a task option (``task.action_tokenizer``,
    ``task.knowledge_insulation.action_tokenizer``)."""

    def check_vocab(self, vocab: int, what: str) -> None:
        """A one-line :class:`ConfigError` when a tokenizer has more ids than the flavor's ``action_vocab``."""
        if vocab > self.action_vocab:
            raise ConfigError(f"{what}: the tokenizer has {vocab} ids, the flavor holds {self.action_vocab} "
                              "(raise model.overrides.action_vocab)")

    def check_tokenizer(self, spec: Any, key: str) -> list[str]:
        """Pre-flight of a tokenizer option ``spec`` (an ``ActionTokenizerOptions`` at ``key``): a saved one is
        opened and held to ``action_vocab``; a line saying what it is (none for one fitted when training starts)."""
        if spec.path is None:
            return []
        from loongforge_embodied.action_tokens.registry import load_action_tokenizer

        tokenizer = load_action_tokenizer(spec.path)
        self.check_vocab(tokenizer.vocab_size, f"{key}.path {spec.path}")
        return [f"{key}: {tokenizer.kind}, {tokenizer.vocab_size} ids"]


@dataclass(frozen=True)
class StreamSizes(PolicyFlavor):
    """The sizes of a policy built on one transformer stream over [images, task bytes, state, actions]: the
    flow-matching Pi0/Pi0.5 policies (which add an action expert's width) and the action-token ones (which add an
    action vocabulary) share them, and the rotary check that comes with ``head_dim``."""

    width: int = 64                  # the stream's (the VLM's) width
    depth: int = 2                   # layers over the whole sequence
    vision_depth: int = 1            # image-only layers before them
    heads: int = 4
    head_dim: int = 16
    mlp_ratio: int = 4
    image_size: int = 16
    patch_size: int = 4
    cameras: int = 1
    text_len: int = 32               # task bytes kept (longer texts are cut)
    max_state_dim: int = 8
    max_action_dim: int = 8
    rope_theta: float = 10000.0
    eps: float = 1e-6

    POSITIVE: ClassVar[tuple[str, ...]] = ("width", "depth", "heads", "head_dim", "mlp_ratio", "text_len",
                                           "max_state_dim", "max_action_dim")
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ("vision_depth", "cameras")

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.head_dim % 2:
            raise ConfigError(f"{self.kind} flavor: head_dim {self.head_dim} must be even (rotary embedding)")
