"""``loongforge doctor`` and the listings on this machine: only the sections that apply here, a reason and a next
step for each backend that is not available, and plugin text printed as written (never read as rich markup)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from loongforge.plugins import get_host
from loongforge.registry import Registry
from loongforge.report import registry_table


def loongforge(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def probes() -> dict[str, tuple[bool, str]]:
    return {entry.name: entry.load()().probe() for entry in get_host().registry("device").entries()}


@pytest.fixture(scope="module")
def report() -> str:
    return loongforge("doctor")


@pytest.fixture(scope="module")
def full_report() -> str:
    return loongforge("doctor", "--all")


def section_titles(text: str) -> set[str]:
    return {line.split(" backend (")[0] for line in text.splitlines() if " backend (" in line}


def test_doctor_prints_the_sections_of_available_backends_only(report, full_report):
    state = probes()
    available = {name for name, (ok, _) in state.items() if ok}
    unavailable = sorted(set(state) - available)
    shown = section_titles(report)
    assert not shown & set(unavailable), shown
    if unavailable:
        assert (f"Not shown: the sections of the unavailable backends ({', '.join(unavailable)}); "
                "`loongforge doctor --all` prints them.") in report
        assert set(unavailable) <= section_titles(full_report) | {"cpu"}  # cpu has no rows of its own
    assert "Not shown" not in full_report


def device_rows(text: str) -> dict[str, list[str]]:
    """The "Device backends" table: backend -> its cells, a folded cell's lines joined with spaces."""
    table = text.split("Device backends", 1)[1].split("└", 1)[0]
    rows: dict[str, list[str]] = {}
    name = None
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[0]:
            name = cells[0]
            rows[name] = cells
        else:
            rows[name] = [" ".join(filter(None, pair)) for pair in zip(rows[name], cells, strict=True)]
    return rows


def test_every_backend_has_a_row_with_its_probe_reason(report):
    rows = device_rows(report)
    for name, (ok, reason) in probes().items():
        assert rows[name][3:] == ["yes" if ok else "no", reason], rows[name]


@pytest.mark.needs_plugins
def test_an_absent_kunlun_stack_is_one_row_saying_what_to_do(report, full_report):
    ok, reason = probes()["xpu"]
    if ok:  # a Kunlun host: the section is the point of the report, so it is shown without --all
        assert "xpu backend (loongforge-xpu)" in report and "BKCL_ENABLE_XDR" in report
        return
    assert reason == ("not present: torch_xmlir (Kunlun XPyTorch) is not importable; on a Kunlun host, install "
                      "Kunlun's XPyTorch wheel into this environment")
    assert "BKCL_" not in report and "XMLIR_" not in report
    assert "xpu backend (loongforge-xpu)" in full_report and "BKCL_ENABLE_XDR" in full_report


@pytest.mark.needs_plugins
def test_the_patch_row_describes_the_environment_training_will_have(monkeypatch):
    from loongforge_xpu.backend import XPUBackend
    from loongforge_xpu.megatron_plugin import GATE, describe_patches

    monkeypatch.delenv(GATE, raising=False)
    training_env = {GATE: "1"}  # what configure_env sets when the user did not
    assert describe_patches(training_env, True) == f"on ({GATE}=1, configure_env's default): applied when training " \
                                                   "starts"
    assert describe_patches(training_env, False) == (
        f"requested ({GATE}=1, configure_env's default) but 'xpu_plugin' is not installed: training runs without "
        "Kunlun's fused megatron-core kernels; install Kunlun's xpu_plugin package")
    monkeypatch.setenv(GATE, "0")
    assert describe_patches({GATE: "0"}, True) == f"off: {GATE}='0' (only 1, True, true turn them on)"
    monkeypatch.setenv(GATE, "true")
    assert describe_patches({GATE: "true"}, True) == f"on ({GATE}=true): applied when training starts"

    monkeypatch.delenv(GATE)
    row = dict(XPUBackend().doctor_rows())["megatron patches"]
    assert not row.startswith("off"), row  # the old report said "off" although configure_env turns them on
    assert GATE not in os.environ  # reporting sets nothing


@pytest.mark.needs_plugins
def test_list_tokenizers_prints_the_extra_in_brackets():
    row = next(line for line in loongforge("list", "tokenizers").splitlines() if line.startswith("│ hf "))
    assert "needs [hf] extra" in row


def test_plugin_text_is_never_read_as_markup(capsys):
    registry = Registry("model")
    registry.current_provider = "some[bold]plugin"
    registry.register("odd", object(), aliases=["[red]alias"], description="pip install 'x[te]'; [bold]loud[/bold]")
    registry_table(registry)
    out = capsys.readouterr().out
    assert "pip install 'x[te]'; [bold]loud[/bold]" in out
    assert "[red]alias" in out and "some[bold]plugin" in out
