"""``benchmarks/lockstep.py``: the benchmarks' workers run strictly one at a time, turn by turn, start and exit one
at a time, and a failing worker is reported by name with nothing left running. The benchmarks' ratios rest on
this: two sides measured in overlapping turns would share the cores and both read slow."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _lockstep():
    spec = importlib.util.spec_from_file_location("lockstep", BENCHMARKS / "lockstep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lockstep = _lockstep()

#: A worker that logs its start, each turn's start and end (a short sleep between), and its exit, to one shared file.
WORKER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {benchmarks!r})
    from lockstep import Baton
    name, log, turns, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    def note(event):
        with open(log, "a") as f:
            f.write(f"{{name}} {{event}}\\n")

    note("boot")
    with open(log + "." + name + ".pid", "w") as f:
        f.write(str(os.getpid()))
    baton = Baton.from_environment()
    for turn in range(turns):
        baton.take()
        if turn == fail_at:
            print(f"{{name}} broke on turn {{turn}}", file=sys.stderr)
            sys.exit(3)
        note(f"start {{turn}}")
        time.sleep(0.03)
        note(f"end {{turn}}")
        baton.give_back()
    baton.wait_to_finish()
    note("exit")
    print("some earlier output")
    print(json.dumps({{"name": name, "pid": os.getpid()}}))
""")


def _commands(tmp_path: Path, names: list[str], turns: int, fail: dict[str, int] | None = None) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(benchmarks=str(BENCHMARKS)))
    log = tmp_path / "log"
    return {name: [sys.executable, str(script), name, str(log), str(turns), str((fail or {}).get(name, -1))]
            for name in names}


def _log(tmp_path: Path) -> list[str]:
    return (tmp_path / "log").read_text().splitlines()


def test_workers_take_turns_one_at_a_time_and_start_and_exit_in_order(tmp_path):
    results = lockstep.run_in_lockstep(_commands(tmp_path, ["a", "b", "c"], turns=3), turns=3)
    assert {name: result["name"] for name, result in results.items()} == {"a": "a", "b": "b", "c": "c"}
    expected = ["a boot", "a start 0", "a end 0", "b boot", "b start 0", "b end 0", "c boot", "c start 0", "c end 0"]
    for turn in (1, 2):
        expected += [f"{name} {event} {turn}" for name in "abc" for event in ("start", "end")]
    assert _log(tmp_path) == expected + ["a exit", "b exit", "c exit"]
    for result in results.values():
        with pytest.raises(ProcessLookupError):  # every worker exited and was reaped
            os.kill(result["pid"], 0)


def test_a_failing_worker_is_named_with_its_error_and_the_others_are_killed(tmp_path):
    commands = _commands(tmp_path, ["a", "b"], turns=3, fail={"b": 1})
    with pytest.raises(SystemExit, match=r"side b failed \(exit 3\):\n.*b broke on turn 1") as failure:
        lockstep.run_in_lockstep(commands, turns=3)
    assert "side a" not in str(failure.value)
    assert _log(tmp_path) == ["a boot", "a start 0", "a end 0", "b boot", "b start 0", "b end 0", "a start 1",
                              "a end 1"]  # b broke on its second turn; a, waiting for its third, was not let on
    for name in "ab":
        with pytest.raises(ProcessLookupError):  # killed and reaped: nothing left running
            os.kill(int((tmp_path / f"log.{name}.pid").read_text()), 0)


def test_a_worker_that_prints_no_result_is_reported(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        from lockstep import Baton
        baton = Baton.from_environment()
        baton.take()
        baton.give_back()
        baton.wait_to_finish()
    """))
    with pytest.raises(SystemExit, match="side quiet printed no result"):
        lockstep.run_in_lockstep({"quiet": [sys.executable, str(script)]}, turns=1)


def test_a_worker_started_without_its_parent_says_so(monkeypatch):
    monkeypatch.delenv(lockstep.BATON_VARIABLE, raising=False)
    with pytest.raises(SystemExit, match="runs under its parent"):
        lockstep.Baton.from_environment()


def test_paired_ratio_is_the_median_of_turn_by_turn_ratios_not_the_ratio_of_medians():
    # turn by turn 2, 4, 3 -> 3; the ratio of the medians would be 4 / 1 = 4
    assert lockstep.paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0
    with pytest.raises(ValueError):
        lockstep.paired_ratio([1.0, 2.0], [1.0])


def test_the_worker_result_is_the_last_line_of_its_output(tmp_path):
    results = lockstep.run_in_lockstep(_commands(tmp_path, ["only"], turns=1), turns=1)
    assert json.dumps(results["only"]).startswith('{"name": "only"')
