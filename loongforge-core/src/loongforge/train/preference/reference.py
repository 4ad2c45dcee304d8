"""The reference model of a DPO run: what scores the pairs the policy is compared with (``dpo.reference``).

- ``frozen_copy``: a second set of model chunks at the policy's layout (built by the one builder, so tensor- and
  pipeline-parallel like the policy), holding the policy's weights as training starts -- ``model.load``'s, or the
  seed's -- run without gradient and in no optimizer, so that at step 0 it computes exactly what the policy does.
  Built before a resume, so a resumed run's reference is the same starting model, not the resumed weights.
- ``adapters_off``: under ``model.lora`` the starting model is the policy with its adapters left out (their ``B``
  starts at zero and the base is frozen), so the policy's own chunks run the reference pass with the adapters off
  (:func:`loongforge.models.lora.adapters_disabled`): no second copy of the weights.
- ``none``: no reference (SimPO, reference-free DPO).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from loongforge.models.lora import ADAPTER, adapters_disabled

#: State-dict keys that are not weights (Transformer Engine's per-module extra state).
_EXTRA_STATE = "_extra_state"


@dataclass(frozen=True)
class ReferenceModel:
    """How a reference pass runs: through ``chunks`` (a frozen copy), or, when ``None``, through the policy's chunks
    with its LoRA adapters off."""

    kind: str
    chunks: list[Any] | None = None

    @property
    def adapters_off(self) -> bool:
        return self.chunks is None

    @contextlib.contextmanager
    def scoring(self, policy: list[Any]) -> Iterator[list[Any]]:
        """The chunks a reference pass runs through: the frozen copy, or ``policy`` with its adapters off inside the
        block."""
        if self.adapters_off:
            with adapters_disabled(policy):
                yield policy
            return
        if not self.chunks:
            raise RuntimeError("the reference's frozen copy was dropped once its log-probs were precomputed")
        yield self.chunks


def build_reference(kind: str, policy: list[Any], build_chunks: Any) -> ReferenceModel | None:
    """The run's reference of ``kind``: ``None`` for ``none``; for ``frozen_copy``, ``build_chunks()`` (this rank's
    chunks at the run's layout) filled with the weights of ``policy`` (this rank's chunks as built and loaded,
    before DDP)."""
    if kind == "none":
        return None
    if kind == "adapters_off":
        return ReferenceModel(kind)
    chunks = build_chunks()
    for copy, source in zip(chunks, policy, strict=True):
        copy_weights(source, copy)
        copy.eval()
    return ReferenceModel(kind, chunks)


def copy_weights(source: Any, target: Any) -> None:
    """``target``'s weights set to ``source``'s, LoRA adapters left out (they start at zero, so the base is the
    starting model); every weight of ``target`` must be among them.

    Each weight also keeps the source's ``requires_grad``: megatron computes a linear layer whose weight is frozen
    through another function than a trained one (on the CPU another GEMM library), which rounds differently, and the
    reference must compute what the policy computed at the start -- at step 0 every margin is exactly 0. The copy
    is "frozen" by use instead: it is in no optimizer and runs only without gradient."""
    state = {key: value for key, value in source.state_dict().items() if f".{ADAPTER}." not in key}
    missing, _ = target.load_state_dict(state, strict=False)
    missing = [key for key in missing if not key.endswith(_EXTRA_STATE)]
    if missing:
        raise RuntimeError(f"dpo.reference frozen_copy: the copy has weights the policy lacks: {', '.join(missing)}")
    trained = {name: param.requires_grad for name, param in source.named_parameters()}
    for name, param in target.named_parameters():
        param.requires_grad_(trained[name])
