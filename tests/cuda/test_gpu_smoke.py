"""``benchmarks/gpu_smoke.py``: which cases a GPU gets, and its CPU dry run end to end (children, both runners, the
CUDA-vs-CPU numerics, the JSON it writes); the machine check that names every missing module at once, the
``--with-tests`` summary, ``gpu_smoke.sh --wheels`` and ``benchmarks/gpu_wheels.sh`` (with a FAKE pip and a FAKE
``nvidia-smi``: no network, no GPU). The GPU figures themselves need a GPU; this keeps the script runnable until
one is lent."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = [pytest.mark.needs_plugins]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"
SMOKE_SH = ROOT / "benchmarks" / "gpu_smoke.sh"
WHEELS_SH = ROOT / "benchmarks" / "gpu_wheels.sh"
ALL_TE = frozenset({"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"})


@functools.cache
def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _reasons(planned) -> dict[str, str | None]:
    return {case.name: reason for case, reason in planned}


def test_an_h200_with_te_runs_every_case_but_mxfp8():
    reasons = _reasons(_script().plan(te_classes=ALL_TE, capability=(9, 0)))
    assert reasons.pop("lf-te-fp8-mxfp8") == "needs compute capability 10.0+"
    assert set(reasons) == {"lf-local-bf16", "mcore-local-bf16", "lf-te-bf16", "mcore-te-bf16", "lf-te-fp8-delayed",
                            "lf-te-fp8-tensorwise", "lf-te-fp8-blockwise", "lf-te-bf16-compiled",
                            "lf-local-bf16-compiled", "lf-local-fp16"}
    assert set(reasons.values()) == {None}


def test_without_te_only_local_cases_run():
    reasons = _reasons(_script().plan(te_classes=frozenset(), capability=(9, 0)))
    runs = {name for name, reason in reasons.items() if reason is None}
    assert runs == {"lf-local-bf16", "mcore-local-bf16", "lf-local-bf16-compiled", "lf-local-fp16"}
    assert reasons["lf-te-fp8-delayed"] == "transformer-engine is not installed"
    # an older TE without the blockwise recipe class: that recipe is named as missing, the others run
    old_te = _reasons(_script().plan(te_classes=ALL_TE - {"Float8BlockScaling"}, capability=(9, 0)))
    assert old_te["lf-te-fp8-blockwise"] == "Transformer Engine lacks Float8BlockScaling"
    assert old_te["lf-te-fp8-tensorwise"] is None


@pytest.mark.slow
def test_dry_run_trains_both_sides_on_the_cpu_and_writes_the_json(tmp_path):
    out = tmp_path / "smoke.json"
    # a generous budget: on idle cores the run takes ~30 s, on shared CI cores many times that
    child = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-s", "1200",
                            "--cases", "lf-local-bf16", "mcore-local-bf16", "lf-te-bf16"],
                           capture_output=True, text=True, timeout=1500)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["device"] == "cpu" and report["peak_bf16_tflops"] is None
    assert report["shape"] == {"model": "llama-tiny", "seq_length": 64, "micro_batch_size": 2, "precision": "fp32"}
    rows = {row["case"]: row for row in report["cases"]}
    assert list(rows) == ["lf-local-bf16", "mcore-local-bf16", "lf-te-bf16"]
    assert rows["lf-te-bf16"]["status"] == "not run" and rows["lf-te-bf16"]["reason"] == "CPU dry run"
    module = _script()
    for name in ("lf-local-bf16", "mcore-local-bf16"):
        row = rows[name]
        assert row["status"] == "ok" and set(module.RESULT_KEYS) <= set(row)
        assert row["tokens_per_s"] == pytest.approx(64 * 2 / (row["step_ms"] / 1e3))
        assert row["tflops"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
        assert row["mfu"] is None  # no peak on a CPU
        # both sides train the same tiny Llama from random weights over a 384-id vocabulary: loss near ln(384)
        assert 4.0 < row["final_loss"] < 7.5
    assert rows["lf-local-bf16"]["flops_per_token"] == rows["mcore-local-bf16"]["flops_per_token"]
    assert set(report["ratios"]) == {"lf-local-bf16 / mcore-local-bf16"}
    # the numerics: the quickstart fp32 on both sides, which in the dry run are both the CPU -- so no difference
    numerics = report["cpu_vs_cuda"]
    assert numerics["status"] == "ok" and numerics["cuda_side_device"] == "cpu (dry run)"
    assert numerics["config"] == "configs/quickstart.yaml" and numerics["model"] == "llama-tiny"
    assert numerics["steps"] == 5 and numerics["seed"] == 1234 and numerics["tolerance_rel"] == 1e-4
    assert len(numerics["losses"]["cuda"]) == len(numerics["losses"]["cpu"]) == len(numerics["rel_diff"]) == 5
    assert numerics["max_rel_diff"] == 0.0 and numerics["within_tolerance"]
    assert numerics["losses"]["cuda"] == numerics["losses"]["cpu"]
    assert numerics["final_loss"]["cuda"] == numerics["final_loss"]["cpu"] == numerics["losses"]["cpu"][-1]
    assert 4.0 < numerics["losses"]["cpu"][-1] < numerics["losses"]["cpu"][0] < 6.5  # it learns (ln 256 = 5.5)
    assert numerics["tf32"] is False
    assert numerics["matmul"]["cuda"]["after"]["float32_matmul_precision"] == "highest"
    # what was installed, and what was missing, goes with the figures
    versions = report["versions"]
    assert versions["torch"] == metadata.version("torch") and versions["megatron-core"] == metadata.version(
        "megatron-core")
    assert {"python", "loongforge-core", "loongforge-cuda", "transformer-engine", "flash-attn"} <= set(versions)
    if importlib.util.find_spec("transformer_engine") is None:
        assert report["missing_optional"]["transformer-engine"] == "not installed"
    assert report["tests"] is None  # no --with-tests


def test_numerics_comparison_holds_every_step_to_the_tolerance():
    compare = _script().compare_losses
    close = compare([5.0, 4.0, 3.0], [5.0, 4.0001, 3.0])
    assert close["within_tolerance"] and close["max_rel_diff"] == pytest.approx(0.0001 / 4.0001)
    assert close["rel_diff"][0] == 0.0
    far = compare([5.0, 4.0, 3.0], [5.0, 4.0, 3.01])  # only the last step drifts: out of tolerance
    assert not far["within_tolerance"] and far["max_rel_diff"] == pytest.approx(0.01 / 3.01)
    assert not compare([5.0, float("nan")], [5.0, 4.0])["within_tolerance"]
    short = compare([5.0], [5.0, 4.0])
    assert not short["within_tolerance"] and "1 losses on the cuda side, 2 on the cpu side" in short["reason"]


def test_the_machine_check_names_every_missing_module_at_once(capsys):
    module = _script()
    report = module.machine_report(
        required=(("textwrap", "no-such-dist"), ("no_such_module_a", "a-dist"), ("no_such_module_b.core", "b-dist")),
        optional=(("no_such_optional", "optional-dist"),))
    assert report["versions"]["no-such-dist"] == "unknown"  # imports, no distribution: still counted as found
    assert report["versions"]["a-dist"] is None and report["versions"]["optional-dist"] is None
    assert report["missing_optional"] == {"optional-dist": "not installed"}
    assert [p for p in report["problems"] if "no_such" in p] == [
        f"gpu_smoke: no_such_module_a is not installed in {sys.executable} (see the header of benchmarks/gpu_smoke.sh)",
        f"gpu_smoke: no_such_module_b.core is not installed in {sys.executable} (see the header of "
        "benchmarks/gpu_smoke.sh)"]
    assert module.check(report) == 1
    out, err = capsys.readouterr()
    assert "optional, missing: optional-dist (not installed): those cases will be listed as not run" in out
    assert "no_such_module_a is not installed" in err and "no_such_module_b.core is not installed" in err


def test_with_tests_summarises_pytest_into_the_json(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_example.py").write_text(textwrap.dedent("""
        import pytest

        def test_good():
            pass

        def test_bad():
            assert 1 == 2

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        @pytest.mark.slow
        def test_slow_is_left_out():
            assert False
    """))
    block = _script().run_tests(str(suite), timeout=300)
    assert block["status"] == "failed" and block["returncode"] == 1
    assert (block["passed"], block["failed"], block["errors"], block["skipped"]) == (1, 1, 0, 1)
    # junit class names are relative to pytest's rootdir, which depends on where the checkout lies
    assert len(block["failures"]) == 1 and block["failures"][0].endswith("test_example::test_bad")
    assert "test_bad" in block["tail"]
    assert block["command"] == f"pytest -q -m 'not slow' {suite}"
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    (stuck / "test_stuck.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(60)\n")
    assert _script().run_tests(str(stuck), timeout=1)["status"] == "timed out"


#: A FAKE pip for gpu_wheels.sh: logs its arguments, and "downloads"/"builds" wheels of FAKE_WHEEL_BYTES zero bytes.
FAKE_PIP = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path

    args = sys.argv[1:]
    with open(os.environ["FAKE_PIP_LOG"], "a") as log:
        log.write(json.dumps(args) + "\\n")
    size = int(os.environ["FAKE_WHEEL_BYTES"])
    if args[0] == "download":
        out = Path(args[args.index("-d") + 1])
        name, version = args[-1].split("==")
        wheels = [f"{name.replace('-', '_')}-{version}-py3-none-any.whl"]
        if name == "importlib-metadata":  # its dependencies come along
            wheels += ["zipp-9.9-py3-none-any.whl"]
    else:
        out = Path(args[args.index("-w") + 1])
        assert all((Path(path) / "pyproject.toml").is_file() for path in args[-2:]), args
        wheels = [f"{Path(path).name.replace('-', '_')}-0.0-py3-none-any.whl" for path in args[-2:]]
    for wheel in wheels:
        (out / wheel).write_bytes(bytes(size))
""")


def _gpu_wheels(tmp_path, *args, wheel_bytes=1 << 20):
    (tmp_path / "fake_pip.py").write_text(FAKE_PIP)
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS_PIP": f"{sys.executable} {tmp_path / 'fake_pip.py'}",
           "FAKE_PIP_LOG": str(tmp_path / "pip.log"), "FAKE_WHEEL_BYTES": str(wheel_bytes)}
    child = subprocess.run(["bash", str(WHEELS_SH), *args], capture_output=True, text=True, env=env, timeout=120)
    calls = [json.loads(line) for line in (tmp_path / "pip.log").read_text().splitlines()] \
        if (tmp_path / "pip.log").exists() else []
    return child, calls


def test_gpu_wheels_fetches_what_the_device_lacks_and_reports_the_size(tmp_path):
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "loongforge_core-0.0.1-py3-none-any.whl").write_bytes(b"stale")  # an older build: removed
    child, calls = _gpu_wheels(tmp_path, str(out))
    assert child.returncode == 0, child.stdout + child.stderr
    assert sorted(path.name for path in out.iterdir()) == [
        f"importlib_metadata-{metadata.version('importlib-metadata')}-py3-none-any.whl",
        "loongforge_core-0.0-py3-none-any.whl", "loongforge_cuda-0.0-py3-none-any.whl",
        f"megatron_core-{metadata.version('megatron-core')}-py3-none-any.whl", "zipp-9.9-py3-none-any.whl"]
    assert "gpu_wheels: 5 wheels in" in child.stdout and "total 5.00 MiB (limit 60 MiB)" in child.stdout
    download_mcore, download_metadata, build = calls
    # megatron-core pinned to the version installed here, a CPython 3.12 manylinux binary, without dependencies
    assert download_mcore[-1] == f"megatron-core=={metadata.version('megatron-core')}" and "--no-deps" in download_mcore
    for call in (download_mcore, download_metadata):
        assert call[0] == "download" and "--only-binary=:all:" in call
        assert call[call.index("--python-version") + 1] == "3.12" and call[call.index("--implementation") + 1] == "cp"
        assert "manylinux_2_28_x86_64" in call and "manylinux_2_17_x86_64" in call
    assert "--no-deps" not in download_metadata  # zipp and lazy-importer come along
    assert build[0] == "wheel" and "--no-deps" in build and "--no-build-isolation" in build
    assert [Path(path).name for path in build[-2:]] == ["loongforge-core", "loongforge-cuda"]
    assert str(ROOT) not in build[-1]  # built from a clean copy, not in the working tree


def test_gpu_wheels_fails_clearly_over_the_size_limit(tmp_path):
    child, _ = _gpu_wheels(tmp_path, str(tmp_path / "wheels"), "--limit-mib", "4")
    assert child.returncode == 1
    assert "total 5.00 MiB, over the limit of 4 MiB" in child.stderr
    child, _ = _gpu_wheels(tmp_path, "--limit-mib", "lots", str(tmp_path / "w2"))
    assert child.returncode == 2 and "--limit-mib takes a number of MiB" in child.stderr


def _fake_wheel(folder: Path) -> Path:
    """A FAKE ``flash-attn`` 9.9.9 wheel (a module with a version, nothing else)."""
    wheel = folder / "flash_attn-9.9.9-py3-none-any.whl"
    info = "flash_attn-9.9.9.dist-info"
    files = {"flash_attn/__init__.py": '__version__ = "9.9.9"\n',
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: flash-attn\nVersion: 9.9.9\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return wheel


def test_gpu_smoke_sh_installs_the_wheels_then_names_everything_missing(tmp_path):
    bin_dir, wheels, empty = tmp_path / "bin", tmp_path / "wheels", tmp_path / "empty"
    for folder in (bin_dir, wheels, empty):
        folder.mkdir()
    nvidia_smi = bin_dir / "nvidia-smi"  # a FAKE nvidia-smi that finds one GPU
    nvidia_smi.write_text("#!/bin/sh\necho 'GPU 0: FAKE GPU (UUID: GPU-0)'\n")
    nvidia_smi.chmod(0o755)
    _fake_wheel(wheels)
    # CUDA_VISIBLE_DEVICES="": torch sees no GPU on a GPU machine too, so the check stops it here as well
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "GPU_SMOKE_SITE": str(tmp_path / "site"), "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run(["bash", str(SMOKE_SH), "--wheels", str(wheels), "--dry-run"], capture_output=True,
                           text=True, env=env, timeout=300)
    # the wheel went into the private site, first on PYTHONPATH: the check finds flash-attn; torch sees no CUDA,
    # which stops the run before any training (exit 1), with the optional TE named, not fatal
    assert child.returncode == 1, child.stdout + child.stderr
    assert (tmp_path / "site" / "flash_attn" / "__init__.py").is_file()
    assert "installing 1 wheels from" in child.stdout and "flash-attn 9.9.9" in child.stdout
    assert "sees no CUDA device (a CPU build of torch?)" in child.stderr
    if importlib.util.find_spec("transformer_engine") is None:
        assert "optional, missing: transformer-engine (not installed): those cases will be listed as not run" \
            in child.stdout
    child = subprocess.run(["bash", str(SMOKE_SH), "--wheels", str(empty)], capture_output=True, text=True, env=env,
                           timeout=60)
    assert child.returncode == 2 and f"no wheels in {empty}" in child.stderr
