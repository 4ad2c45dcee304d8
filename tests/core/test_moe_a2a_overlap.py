"""``parallel.moe_a2a_overlap``: the MoE token exchange overlapped with compute, bitwise equal to no overlap.

One torchrun launch (tests/core/moe_overlap_worker.py, 2 gloo processes) trains a small Mixtral at ep=2 through the
real trainer without and with the overlap; on CPU the overlap is the per-local-expert chunked exchange of
:mod:`loongforge.parallel.moe_overlap`. Every step's loss, grad norm and load-balancing loss must be *equal* (not
close): the schedule only moves data. The recorded schedule must show each expert computing while the next
expert's dispatch and the previous expert's combine are issued and not yet waited on -- in every MoE layer call on
both ranks -- so the exchange really is in flight during compute rather than the same sequential code path.
The pre-flight checks (both devices' prerequisites) run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge import load_config
from loongforge.devices.cpu import CPUBackend
from loongforge.errors import ConfigError
from loongforge.parallel.megatron import MegatronStrategy
from loongforge.parallel.moe_overlap_check import check_moe_a2a_overlap, megatron_overlap_kwargs
from loongforge.resolve import decoder_flavor, resolve_model_flavor

WORKER = Path(__file__).with_name("moe_overlap_worker.py")
STEPS, MICRO_BATCHES, LAYERS, LOCAL_EXPERTS = 3, 2, 2, 2


def _calls(trace: list) -> list[list]:
    """The trace cut into one list of events per overlapped layer call (each starts with dispatch 0's issue)."""
    calls: list[list] = []
    for event, chunk, outstanding in trace:
        if (event, chunk) == ("dispatch_issue", 0):
            calls.append([])
        calls[-1].append((event, chunk, [tuple(o[:2]) for o in outstanding]))
    return calls


def _assert_overlapped(call: list) -> None:
    """Expert j computes after dispatch j+1 is issued and before it is waited on; combine j-1 likewise."""
    at = {(event, chunk): i for i, (event, chunk, _) in enumerate(call)}
    assert len(at) == len(call) == 6 * LOCAL_EXPERTS, call
    for j in range(LOCAL_EXPERTS):
        start, end = at["compute_start", j], at["compute_end", j]
        assert at["dispatch_wait", j] < start < end < at["combine_issue", j]
        if j + 1 < LOCAL_EXPERTS:
            assert at["dispatch_issue", j + 1] < start and end < at["dispatch_wait", j + 1]
        if j >= 1:
            assert at["combine_issue", j - 1] < start and end < at["combine_wait", j - 1]
        expected = [("dispatch", j + 1)] * (j + 1 < LOCAL_EXPERTS) + [("combine", j - 1)] * (j >= 1)
        assert call[start][2] == expected


@pytest.mark.distributed
def test_overlap_is_bitwise_equal_and_the_exchange_is_in_flight_during_expert_compute(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    off, on = result["off"], result["on"]
    assert [row["step"] for row in on] == [row["step"] for row in off] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert [row[key] for row in on] == [row[key] for row in off], key
    assert off[-1]["loss"] < off[0]["loss"] - 0.05  # it learns: equal values are not constants
    for rank in result["traces"]:
        assert rank["off"] == []  # without the option no layer runs the schedule
        calls = _calls(rank["on"])
        assert len(calls) >= STEPS * MICRO_BATCHES * LAYERS  # every MoE layer, every micro-batch (and any sample)
        for call in calls:
            _assert_overlapped(call)


class _StreamsDevice:
    """A device answering ``supports("streams")`` like CUDA does (what selects megatron-core's own overlap)."""

    name = "gpu"

    def supports(self, feature: str) -> bool:
        return feature == "streams"


def _config(*overrides: str):
    return load_config(None, ["model.name=mixtral-tiny", "parallel.ep=2", "parallel.moe_a2a_overlap=true",
                              *overrides])


def _check(config, backend, world_size: int = 2):
    layout = MegatronStrategy.validate(config.parallel, world_size, config.source)
    return check_moe_a2a_overlap(config, layout, decoder_flavor(resolve_model_flavor(config)), backend)


def test_preflight_names_each_devices_mechanism_and_refuses_what_it_cannot_run():
    assert "chunked per local expert (2 per rank)" in _check(_config(), CPUBackend())
    assert _check(_config("parallel.moe_a2a_overlap=false"), CPUBackend()) is None
    with pytest.raises(ConfigError, match="needs parallel.ep > 1 and moe_dispatcher alltoall"):
        _check(_config("parallel.ep=1"), CPUBackend())
    with pytest.raises(ConfigError, match="needs parallel.ep > 1 and moe_dispatcher alltoall"):
        _check(_config("parallel.moe_dispatcher=allgather"), CPUBackend())
    with pytest.raises(ConfigError, match="needs >= 2 experts per ep rank; the model's 4 experts over ep=4 leave 1"):
        _check(_config("parallel.ep=4"), CPUBackend(), world_size=4)
    with pytest.raises(ConfigError, match="needs whole experts: set parallel.etp=1"):
        _check(_config("parallel.tp=2"), CPUBackend(), world_size=4)
    with pytest.raises(ConfigError, match="recomputing the MoE layer"):
        _check(_config("model.recompute.granularity=selective", "model.recompute.modules=[moe]"), CPUBackend())
    # megatron-core's own overlap on a device with streams: its prerequisites, checked before megatron asserts them
    assert "overlap_moe_expert_parallel_comm" in _check(_config("training.precision=bf16"), _StreamsDevice())
    with pytest.raises(ConfigError, match="needs training.precision bf16 or fp16, got fp32"):
        _check(_config(), _StreamsDevice())
    with pytest.raises(ConfigError, match="with parallel.pp=2 needs parallel.vpp"):
        _check(_config("training.precision=bf16", "parallel.pp=2"), _StreamsDevice(), world_size=4)
    with pytest.raises(ConfigError, match="does not combine with model.recompute granularity full"):
        _check(_config("training.precision=bf16", "model.recompute.granularity=full"), _StreamsDevice())


def test_streams_devices_pass_megatrons_own_switch_which_megatron_accepts_as_checked():
    """The switch reaches megatron's ``TransformerConfig`` only on a device with streams, and megatron's own
    validation accepts the layout the pre-flight accepted (and refuses fp32, as the pre-flight does)."""
    from loongforge.models.decoder_model import ParallelSettings, transformer_config

    config = _config("training.precision=bf16")
    layout = MegatronStrategy.validate(config.parallel, 2, config.source)
    assert megatron_overlap_kwargs(layout, CPUBackend()) == {}
    kwargs = megatron_overlap_kwargs(layout, _StreamsDevice())
    flavor = decoder_flavor(resolve_model_flavor(config))
    parallel = ParallelSettings(ep=2)
    assert transformer_config(flavor, params_dtype="bf16", parallel=parallel,
                              extra_config=kwargs).overlap_moe_expert_parallel_comm
    with pytest.raises(AssertionError, match="only supported with bf16 or fp16"):
        transformer_config(flavor, params_dtype="fp32", parallel=parallel, extra_config=kwargs)
