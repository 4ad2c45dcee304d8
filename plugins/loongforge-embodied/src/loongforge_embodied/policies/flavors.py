"""``Pi05Flavor`` and ``Pi0Flavor``: the sizes of one Pi0.5- or Pi0-style policy, and the table of named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay instant
(the policy-protocol methods import torch when called). These are compact CPU-sized policies with their own layers
(``blocks``); the real Pi0.5 architecture (PaliGemma 3B: SigLIP So400m + Gemma 2B, with a Gemma-300M action expert)
is :mod:`~loongforge_embodied.policies.pi05_gemma_flavors` (``pi05-base``), which loads LeRobot/openpi weights.

A flavor is what :class:`~loongforge_embodied.train_task.PolicyTask` trains: ``build_policy``, ``frame_inputs``
(one frame's model inputs besides images) and ``flow_matching`` (the time convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.listing import size_label

from loongforge_embodied.policies.flavor_base import ActionTokenVocab, StreamSizes
from loongforge_embodied.task_options import Pi05TaskOptions

#: Byte-token vocabulary: padding + 256 byte values (see ``prompt.vocab_size``).
TEXT_VOCAB = 1 + 256
#: Ids after a vocabulary's action tokens: the start-of-actions and end-of-actions markers.
MARKERS = 2


@dataclass(frozen=True)
class PaliSizes(StreamSizes):
    """What Pi0 and Pi0.5 share. Both streams share the attention geometry (``heads`` x ``head_dim``), as Pi0's
    PaliGemma and action expert do, and differ in width; states and actions are zero-padded to ``max_state_dim`` /
    ``max_action_dim`` (Pi0 pads to 32) so one model fits robots with fewer dimensions. ``cameras: 0`` is a
    state-only policy (no image tokens)."""

    kind: ClassVar[str] = "pali"
    expert_width: int = 32           # action expert width (the stream's is ``width``)

    POSITIVE: ClassVar[tuple[str, ...]] = (*StreamSizes.POSITIVE, "expert_width")

    def flow_matching(self) -> Any:
        """Pi0's convention (time 1 = noise, Beta(1.5, 1) times, velocity ``noise - actions``), for both."""
        from loongforge_embodied.policies import flow_matching

        return flow_matching

    def _backbone_params(self, *, vocab: int, adaptive_expert: bool, prefix_output: bool = False) -> int:
        """Parameters of the image tower, the token embedding and the joint layers (``blocks.JointPolicy``);
        ``prefix_output``: the last layer's prefix stream is complete (a head reads it)."""
        w, e, a = self.width, self.expert_width, self.heads * self.head_dim

        def stream(width: int, cond: int | None, output: bool) -> int:
            norm = cond * 3 * width + 3 * width if cond else width
            hidden = self.mlp_ratio * width
            return norm + 3 * width * a + ((a * width + norm + 3 * width * hidden) if output else 0)

        vision = 0
        if self.cameras:
            vision = 3 * self.patch_size ** 2 * w + w + self.cameras * self.patches * w
            vision += self.vision_depth * stream(w, None, True)
        expert_cond = e if adaptive_expert else None
        layers = sum(stream(w, None, i < self.depth - 1 or prefix_output) + stream(e, expert_cond, True)
                     for i in range(self.depth))
        return vision + vocab * w + layers

    def _describe(self, what: str) -> str:
        return (f"{what} VLA policy (flow matching), {size_label(self.num_params())} params, {self.depth} joint "
                f"layers, width {self.width} / expert {self.expert_width}, {self.heads} heads x {self.head_dim}, "
                f"{self.inputs_summary()}")


@dataclass(frozen=True)
class Pi05Flavor(PaliSizes, ActionTokenVocab):
    """A Pi0.5-style policy: the state discretised into ``state_bins`` prompt tokens, time through adaRMS. With
    ``action_vocab`` > 0 the backbone also holds that many FAST ids (then BOS and EOS) and a language head over them:
    what ``task.knowledge_insulation`` trains (see :mod:`~loongforge_embodied.policies.pi05`)."""

    kind: ClassVar[str] = "pi05"
    task_options: ClassVar[type | None] = Pi05TaskOptions
    state_bins: int = 256            # Pi0.5 writes the state as 256-bin tokens
    action_vocab: int = 0            # FAST ids of knowledge insulation; 0: none (flow matching alone)

    POSITIVE: ClassVar[tuple[str, ...]] = (*PaliSizes.POSITIVE, "state_bins")
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = (*PaliSizes.NON_NEGATIVE, "action_vocab")

    @property
    def action_offset(self) -> int:
        """The policy id of FAST id 0: right after the prompt's ids (padding, bytes, state bins)."""
        return TEXT_VOCAB + self.state_bins

    @property
    def vocab_size(self) -> int:
        """The prompt's ids, then (knowledge insulation) the FAST ids and the two markers."""
        return self.action_offset + (self.action_vocab + MARKERS if self.action_vocab else 0)

    @property
    def prefix_len(self) -> int:
        """Image tokens of all cameras, then text bytes, then state tokens."""
        return self.cameras * self.patches + self.text_len + self.max_state_dim

    def build_policy(self) -> Any:
        from loongforge_embodied.policies.pi05 import Pi05Policy

        return Pi05Policy(self)

    def frame_inputs(self, task: str, state: Any) -> dict[str, Any]:
        """``{"tokens": prompt ids}``: the task bytes, then the binned normalised state."""
        from loongforge_embodied.policies.prompt import prompt_tokens

        return {"tokens": prompt_tokens(task, state, text_len=self.text_len, max_state_dim=self.max_state_dim,
                                        state_bins=self.state_bins)}

    def num_params(self) -> int:
        """Parameter count, computed from the sizes (``loongforge list`` must not build the model)."""
        e, act = self.expert_width, self.max_action_dim
        # action_in, time_in + time_out, the final (ungated) adaRMS norm, action_out
        head = (act * e + e) + 2 * (e * e + e) + (2 * e * e + 2 * e) + (e * act + act)
        fast_head = (self.width + self.width * self.vocab_size) if self.action_vocab else 0  # norm, head
        return self._backbone_params(vocab=self.vocab_size, adaptive_expert=True,
                                     prefix_output=self.action_vocab > 0) + head + fast_head

    def make_task(self, config: Any) -> Any:
        """The policy task, or with ``task.knowledge_insulation`` the task that adds the FAST loss."""
        from loongforge.config.plugin_sections import task_options

        if task_options(self, config).knowledge_insulation is None:
            return super().make_task(config)
        from loongforge_embodied.insulation_task import KnowledgeInsulationTask

        return KnowledgeInsulationTask(self, config)

    def check_task(self, config: Any, options: Pi05TaskOptions) -> list[str]:
        """The data, as for every policy; with ``task.knowledge_insulation``, FAST ids in the flavor and a saved
        tokenizer opened and held to them."""
        lines = super().check_task(config, options)
        insulation = options.knowledge_insulation
        if insulation is None:
            return lines
        self.check_insulation(config.source)
        key = "task.knowledge_insulation.action_tokenizer"
        return [*lines, *self.check_tokenizer(insulation.action_tokenizer, key)]

    def check_insulation(self, source: str) -> None:
        """A one-line :class:`ConfigError` when knowledge insulation is asked of a flavor without FAST ids."""
        if not self.action_vocab:
            raise ConfigError(f"{source}: task.knowledge_insulation needs FAST ids in the backbone's vocabulary: set "
                              "model.overrides.action_vocab (e.g. 256, the tokenizer's vocab_size or more)")

    def describe(self) -> str:
        """One line for ``loongforge list``."""
        return self._describe("Pi0.5-style")


@dataclass(frozen=True)
class Pi0Flavor(PaliSizes):
    """A Pi0-style policy: a continuous state token and time mixed into the action tokens (see ``pi0``)."""

    kind: ClassVar[str] = "pi0"

    def build_policy(self) -> Any:
        from loongforge_embodied.policies.pi0 import Pi0Policy

        return Pi0Policy(self)

    def frame_inputs(self, task: str, state: Any) -> dict[str, Any]:
        """``{"tokens": task bytes, "state": the normalised state zero-padded to max_state_dim}``."""
        from loongforge_embodied.policies.prompt import padded_state, text_tokens

        return {"tokens": text_tokens(task, self.text_len), "state": padded_state(state, self.max_state_dim)}

    def num_params(self) -> int:
        """Parameter count, computed from the sizes (``loongforge list`` must not build the model)."""
        e, act = self.expert_width, self.max_action_dim
        # state_proj, action_in, action_time_mlp (in + out), the final RMSNorm, action_out
        head = (self.max_state_dim * e + e) + (act * e + e) + (2 * e * e + e) + (e * e + e) + e + (e * act + act)
        return self._backbone_params(vocab=TEXT_VOCAB, adaptive_expert=False) + head

    def describe(self) -> str:
        """One line for ``loongforge list``."""
        return self._describe("Pi0-style")


_SMALL: dict[str, Any] = dict(width=128, expert_width=64, depth=4, vision_depth=2, heads=4, head_dim=32,
                              image_size=32, patch_size=4, text_len=48, max_state_dim=32, max_action_dim=32)

FLAVORS: dict[str, PaliSizes] = {
    "pi05-tiny": Pi05Flavor(),
    "pi05-small": Pi05Flavor(**_SMALL),
    "pi0-tiny": Pi0Flavor(),
    "pi0-small": Pi0Flavor(**_SMALL),
}
