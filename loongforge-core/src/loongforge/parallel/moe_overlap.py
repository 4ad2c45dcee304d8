"""``parallel.moe_a2a_overlap`` on devices without streams: MoE token exchange overlapped with expert compute.

Megatron's own overlap (``overlap_moe_expert_parallel_comm``, its combined 1F1B schedule) puts each micro-batch's
all-to-alls on a CUDA communication stream while another micro-batch computes on the compute stream; on a device
without streams (the CPU under gloo) there is nothing to put them on. This module is the schedule used there. It
overlaps *within* one MoE layer, chunked by local expert, and it is exact:

With ``L`` local experts per rank (``L >= 2``), the alltoall dispatcher's single dispatch all-to-all is split into
``L`` exchanges: exchange ``j`` carries, from every rank, the tokens routed to local expert ``j`` of each
destination (global expert ``r*L + j`` on rank ``r``). Each exchange is issued asynchronously (``async_op=True``
work handles; gloo runs them on its own threads) and the experts run in order::

    issue dispatch 0
    for j in 0..L-1:
        wait dispatch j;  issue dispatch j+1           # the next expert's tokens travel ...
        expert j computes                              # ... while this one computes
        issue combine j                                # and expert j's output travels back while j+1 computes
    wait every combine; reassemble in global-expert order

Expert ``j`` receives exactly the rows, in the same order, that megatron's ``sort_chunks_by_idxs`` gives it after
the single exchange (source rank order), and the reassembled output has exactly the layout megatron's combine
all-to-all produces, which its ``combine_postprocess`` then un-permutes. Every change is a data movement, so the
forward is bitwise equal to the unoverlapped layer; in backward each chunk's exchange is the reverse all-to-all
(synchronous) and every gradient element comes from one chunk, so gradients are bitwise equal too (the overlap is
in the forward pass; the backward's exchanges are not overlapped).

:data:`schedule_trace` records the order of issues, waits and expert computes when set to a list (the test and the
benchmark read it to show that compute ran while an exchange was outstanding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer

__all__ = ["ExpertChunkedMoELayer", "install_expert_chunked_overlap", "schedule_trace"]

#: When a list, every overlapped layer appends ``(event, chunk, outstanding)``: ``event`` is ``dispatch_issue``,
#: ``dispatch_wait``, ``compute_start``, ``compute_end``, ``combine_issue`` or ``combine_wait``; ``outstanding`` (at
#: ``compute_start``) the exchanges issued and not yet waited on, each with whether gloo had finished it then.
schedule_trace: list[tuple[str, int, tuple[tuple[str, int, bool], ...]]] | None = None


def _trace(event: str, chunk: int, outstanding: tuple[tuple[str, int, bool], ...] = ()) -> None:
    if schedule_trace is not None:
        schedule_trace.append((event, chunk, outstanding))


class _AsyncAllToAll(torch.autograd.Function):
    """``all_to_all_single`` issued with ``async_op=True``: the output buffer is returned at once and filled by the
    process group's threads; the caller waits on the work handle appended to ``pending`` before reading it.
    Backward is the reverse exchange (sent sizes and received sizes swapped), synchronous."""

    @staticmethod
    def forward(ctx: Any, group: Any, tokens: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                pending: list[Any]) -> torch.Tensor:
        ctx.group, ctx.send_sizes, ctx.recv_sizes = group, send_sizes, recv_sizes
        tokens = tokens.contiguous()
        received = tokens.new_empty((sum(recv_sizes), *tokens.shape[1:]))
        pending.append(dist.all_to_all_single(received, tokens, recv_sizes, send_sizes, group=group, async_op=True))
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous()
        returned = grad.new_empty((sum(ctx.send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(returned, grad, ctx.send_sizes, ctx.recv_sizes, group=ctx.group)
        return None, returned, None, None, None


class _Exchange:
    """One chunk's exchange (``kind`` ``dispatch`` or ``combine``) in flight: tokens (and routing probabilities) and
    their work handles. Issuing and waiting are traced here, where they happen, so the trace shows the real order."""

    def __init__(self, kind: str, chunk: int, group: Any, tensors: tuple[torch.Tensor, ...], send: list[int],
                 recv: list[int]) -> None:
        self.kind, self.chunk, self.waited = kind, chunk, False
        self.handles: list[Any] = []
        self.outputs = tuple(_AsyncAllToAll.apply(group, t, send, recv, self.handles) for t in tensors)
        _trace(f"{kind}_issue", chunk)

    def state(self) -> tuple[str, int, bool]:
        """``(kind, chunk, finished)``: whether gloo has already completed every handle."""
        return self.kind, self.chunk, all(handle.is_completed() for handle in self.handles)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for handle in self.handles:
            handle.wait()
        if not self.waited:
            _trace(f"{self.kind}_wait", self.chunk)
            self.waited = True
        return self.outputs


class ExpertChunkedMoELayer(MoELayer):
    """Megatron's ``MoELayer`` whose alltoall exchange is split per local expert and overlapped with the experts
    (the module docstring has the schedule).

    The layer's forward calls ``dispatch`` -> ``routed_experts_compute`` -> ``combine``; here ``dispatch`` leaves the
    permuted tokens where they are, ``routed_experts_compute`` runs the whole overlapped exchange-and-compute and
    returns the tokens in the layout megatron's combine all-to-all returns, and ``combine`` passes them on. Routing,
    the auxiliary loss, the dispatcher's metadata and its un-permutation are megatron's own.
    """

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden_states, probs

    def combine(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        dispatcher, experts = self.token_dispatcher, self.experts.local_experts
        local, ep, group = len(experts), dispatcher.ep_size, dispatcher.ep_group
        # Tokens this rank routes to each global expert (the order of ``hidden_states``) and, per local expert,
        # how many each source rank sends here: megatron's own counts.
        sent = dispatcher.routing_map.sum(dim=0).tolist()
        received = torch.as_tensor(dispatcher.num_global_tokens_per_local_expert).reshape(ep, local).tolist()
        starts = [0]
        for count in sent:
            starts.append(starts[-1] + count)

        def exchange(j: int) -> _Exchange:
            rows = [torch.arange(starts[r * local + j], starts[r * local + j + 1]) for r in range(ep)]
            index = torch.cat(rows).to(hidden_states.device)
            send = [sent[r * local + j] for r in range(ep)]
            recv = [received[s][j] for s in range(ep)]
            return _Exchange("dispatch", j, group, (hidden_states.index_select(0, index), probs.index_select(0, index)),
                             send, recv)

        dispatches, combines = [exchange(0)], []
        for j, expert in enumerate(experts):
            tokens, token_probs = dispatches[j].wait()
            if j + 1 < local:
                dispatches.append(exchange(j + 1))
            _trace("compute_start", j, tuple(e.state() for e in dispatches + combines if not e.waited))
            output, bias = expert(tokens, token_probs)
            if bias is not None:
                raise ValueError("parallel.moe_a2a_overlap: experts with a bias are not supported (megatron's "
                                 "alltoall dispatcher refuses them too)")
            _trace("compute_end", j)
            recv = [received[s][j] for s in range(ep)]
            combines.append(_Exchange("combine", j, group, (output,), recv, [sent[r * local + j] for r in range(ep)]))
        returned = [combine.wait()[0] for combine in combines]
        return self._reassembled(returned, sent, ep, local), None

    @staticmethod
    def _reassembled(returned: list[torch.Tensor], sent: list[int], ep: int, local: int) -> torch.Tensor:
        """The chunks' returned rows (chunk ``j``: for each rank ``r``, global expert ``r*L + j``) back in global
        expert order, the layout of megatron's single combine exchange."""
        pieces = []
        for j, chunk in enumerate(returned):
            pieces.append(chunk.split([sent[r * local + j] for r in range(ep)]))
        return torch.cat([pieces[e % local][e // local] for e in range(ep * local)])


def install_expert_chunked_overlap(chunks: list[Any]) -> int:
    """Give every MoE layer of ``chunks`` the overlapped schedule (a class swap: same parameters, same state);
    return how many layers got it. The pre-flight (:func:`loongforge.parallel.moe_overlap_check.check_moe_a2a_overlap`)
    has checked the dispatcher, ep and local expert count."""
    layers = [module for chunk in chunks for module in chunk.modules() if type(module) is MoELayer]
    for layer in layers:
        layer.__class__ = ExpertChunkedMoELayer
    return len(layers)
