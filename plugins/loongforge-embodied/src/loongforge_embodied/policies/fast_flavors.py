"""``Pi0FastFlavor``: the sizes of one autoregressive (action-token) policy, Pi0-FAST-style or OpenVLA-style, and its
named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay instant.
One family serves both token heads: what differs between Pi0-FAST (a few FAST tokens per chunk, ended by an
end-of-actions token) and OpenVLA (one 256-bin token per action value) is the action tokenizer, which is a task option
(``task.action_tokenizer``), not an architecture (see :mod:`~loongforge_embodied.policies.pi0_fast`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.models.listing import size_label

from loongforge_embodied.policies.flavor_base import ActionTokenVocab, StreamSizes
from loongforge_embodied.policies.flavors import MARKERS, TEXT_VOCAB
from loongforge_embodied.task_options import TokenPolicyTaskOptions


@dataclass(frozen=True)
class Pi0FastFlavor(StreamSizes, ActionTokenVocab):
    """A single transformer stream (Pi0-FAST has no action expert) over [images, task bytes, state token, action
    tokens]. Its vocabulary is the byte ids, then ``action_vocab`` action ids (the largest tokenizer it can take:
    FAST's default 1024, or 256 bins), then the two markers. ``max_state_dim`` / ``max_action_dim`` bound the data's
    widths as for the flow-matching policies."""

    kind: ClassVar[str] = "pi0-fast"
    task_options: ClassVar[type | None] = TokenPolicyTaskOptions
    action_vocab: int = 1024         # action token ids the embedding and the head hold

    POSITIVE: ClassVar[tuple[str, ...]] = (*StreamSizes.POSITIVE, "action_vocab")

    @property
    def vocab_size(self) -> int:
        """Padding and bytes, the action ids, the two markers."""
        return TEXT_VOCAB + self.action_vocab + MARKERS

    def build_policy(self) -> Any:
        from loongforge_embodied.policies.pi0_fast import Pi0FastPolicy

        return Pi0FastPolicy(self)

    def frame_inputs(self, task: str, state: Any) -> dict[str, Any]:
        """``{"tokens": task bytes, "state": the normalised state zero-padded to max_state_dim}`` (Pi0's)."""
        from loongforge_embodied.policies.prompt import padded_state, text_tokens

        return {"tokens": text_tokens(task, self.text_len), "state": padded_state(state, self.max_state_dim)}

    def make_task(self, config: Any) -> Any:
        from loongforge_embodied.token_task import TokenPolicyTask

        return TokenPolicyTask(self, config)

    @property
    def action_offset(self) -> int:
        """The policy id of action id 0: right after the bytes."""
        return TEXT_VOCAB

    def check_task(self, config: Any, options: TokenPolicyTaskOptions) -> list[str]:
        """The data, as for every policy, and a saved ``task.action_tokenizer.path`` opened and held to the
        flavor's action vocabulary."""
        return [*super().check_task(config, options),
                *self.check_tokenizer(options.action_tokenizer, "task.action_tokenizer")]

    def num_params(self) -> int:
        """Parameter count, computed from the sizes (``loongforge list`` must not build the model)."""
        w, a, hidden = self.width, self.heads * self.head_dim, self.mlp_ratio * self.width
        layer = 2 * w + 3 * w * a + a * w + 3 * w * hidden  # two norms, qkv, out, gated MLP
        vision = 0
        if self.cameras:
            vision = 3 * self.patch_size ** 2 * w + w + self.cameras * self.patches * w + self.vision_depth * layer
        # embedding, state projection, layers, final norm, head
        return vision + self.vocab_size * w + (self.max_state_dim * w + w) + self.depth * layer + w + w * \
            self.vocab_size

    def describe(self) -> str:
        """One line for ``loongforge list``."""
        return (f"Pi0-FAST-style autoregressive VLA policy (action tokens: FAST or bins), "
                f"{size_label(self.num_params())} params, {self.depth} layers, width {self.width}, {self.heads} heads "
                f"x {self.head_dim}, {self.action_vocab} action ids, {self.inputs_summary()}")


FLAVORS: dict[str, Pi0FastFlavor] = {
    "pi0-fast-tiny": Pi0FastFlavor(),
    "pi0-fast-small": Pi0FastFlavor(width=128, depth=4, vision_depth=2, heads=4, head_dim=32, image_size=32,
                                    text_len=48, max_state_dim=32, max_action_dim=32),
}
