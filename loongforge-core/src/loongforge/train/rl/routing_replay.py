"""MoE routing replay (``grpo.routing_replay``): the experts each token was routed to when its reply was sampled are
reused by every forward of the training step.

Why: a router's top-k is a discontinuous function of the weights, so after one update (``grpo.updates_per_step`` >
1) or with a sampler that rounds differently, the trainer can send a token to other experts than the sampler did --
and its log-prob, and the importance ratio, then jump for reasons that have nothing to do with the policy's change.
Replaying the rollout's choices keeps the experts fixed and lets the gradient flow through the router's scores of
them.

Built on megatron-core's router replay (``megatron.core.transformer.moe.router_replay``, megatron-core >= 0.16): a
:class:`~megatron.core.transformer.moe.router_replay.RouterReplay` is attached to each router of the policy (not to a
frozen reference copy), told to record during one forward over the finished rows and to replay the recorded indices
(megatron gathers the router's scores at them) during the passes that follow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loongforge.errors import ConfigError


def _router_replay() -> Any:
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError:
        raise ConfigError("grpo.routing_replay needs megatron-core >= 0.16 (its router replay); this one has none"
                          ) from None
    return router_replay


class RoutingReplay:
    """The routers of ``chunks`` (the policy's model chunks), ready to record and replay."""

    #: The micro-batch key the recorded indices travel under: ``[layer] -> [tokens, top-k]``.
    KEY = "routing"

    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        replay = _router_replay()
        self._actions = replay.RouterReplayAction
        self.routers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        if not self.routers:
            raise ConfigError("grpo.routing_replay applies to mixture-of-experts models; this model has no router")
        for router in self.routers:
            if router.router_replay is None:
                router.router_replay = replay.RouterReplay()

    def _act(self, action: Any) -> None:
        for router in self.routers:
            router.router_replay.router_replay_action = action

    def recorded(self, forward: Callable[[], Any]) -> list[torch.Tensor]:
        """Each router's top-k indices during ``forward()`` (one forward of the policy)."""
        self._act(self._actions.RECORD)
        try:
            forward()
        finally:
            self._act(None)
        return [router.router_replay.get_recorded_indices().clone() for router in self.routers]

    def target(self, indices: list[torch.Tensor]) -> None:
        """The indices the next forward replays (one micro-batch's, as :meth:`recorded` returned them)."""
        for router, chosen in zip(self.routers, indices, strict=True):
            router.router_replay.target_topk_idx = chosen

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Inside the block, every forward of the routers replays their targets."""
        self._act(self._actions.REPLAY_FORWARD)
        try:
            yield
        finally:
            self._act(None)
            for router in self.routers:
                router.router_replay.clear_indices()
