"""glibc malloc tuning of the CPU backend (:mod:`loongforge.devices.cpu_malloc`).

Counted, not timed: a loop that allocates and frees step-sized tensors page-faults on every round with glibc's
defaults and (almost) never once the thresholds are set; a user's own allocator settings switch the tuning off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from loongforge.devices import cpu_malloc
from loongforge.devices.cpu import CPUBackend

#: Both modes first pin glibc's default mmap threshold (128 KiB) with ``mallopt``. Left dynamic, glibc raises it
#: to the size of the first freed 8 MiB block, and whether later rounds fault then depends on what else the
#: interpreter happened to allocate above them on the heap (a run of this suite once saw no faults without the
#: tuning). Pinned, every round maps fresh pages unless the tuning raises the thresholds.
FAULT_LOOP = """
    import ctypes, json, resource, sys, torch
    from loongforge.devices.cpu import CPUBackend
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD, no longer dynamic
    if sys.argv[1] == "tuned":
        CPUBackend().configure_env()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):  # warm up: the heap grows to the working set once
        tensors = [torch.ones(2 << 20) for _ in range(4)]  # 8 MiB each, above glibc's 128 KiB default threshold
        del tensors
    start = faults()
    for _ in range(10):
        tensors = [torch.ones(2 << 20) for _ in range(4)]
        del tensors
    print(json.dumps({"faults_per_round": (faults() - start) / 10}))
"""


def _faults_per_round(mode: str) -> float:
    """Faults per allocate/free round in a fresh interpreter without any allocator setting of the caller's."""
    mine = (*cpu_malloc.USER_CHOICE_VARIABLES, "LD_PRELOAD", cpu_malloc.OPT_OUT_VARIABLE)
    env = {name: value for name, value in os.environ.items() if name not in mine}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(FAULT_LOOP), mode], capture_output=True,
                            text=True, timeout=120, check=False, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["faults_per_round"]


def test_tuned_allocator_reuses_freed_pages() -> None:
    default = _faults_per_round("default")
    tuned = _faults_per_round("tuned")
    assert default > 2048  # most of the 4 x 8 MiB are fresh 4 KiB pages again every round
    assert tuned < 100, (default, tuned)


@pytest.mark.parametrize(("variable", "value"), [("LOONGFORGE_CPU_MALLOC", "system"),
                                                  ("MALLOC_TRIM_THRESHOLD_", "131072"),
                                                  ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
                                                  ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")])
def test_user_allocator_choices_win(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    for name in (*cpu_malloc.USER_CHOICE_VARIABLES, "LD_PRELOAD", cpu_malloc.OPT_OUT_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    assert cpu_malloc.tune_glibc_malloc().startswith("malloc: left as configured")
    assert dict(CPUBackend().doctor_rows())["malloc"].startswith("left as configured")
    assert variable in cpu_malloc.planned_malloc()
