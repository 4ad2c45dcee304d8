"""Background checkpoint saves (``checkpoint.async_save``), per-rank manifest hashing and ``checkpoint.verify``.

End to end through the CLI on the tiny ``llama-debug`` model (subprocesses keep megatron's global state out of this
process): a background save writes the very bytes a synchronous save writes; a process SIGKILLed while its
background thread is writing leaves only ``.tmp-step-N`` and the same command resumes bit-exactly from the checkpoint
before; with two data-parallel ranks each rank hashes its own files and the merged manifest equals one process
hashing everything. The verification levels are checked on files with many blocks, without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from loongforge.checkpoint.layout import find_checkpoint
from loongforge.checkpoint.manifest import (
    BLOCK_SIZE,
    MANIFEST,
    SAMPLED_BLOCKS,
    CheckpointCorruptError,
    ManifestIncompleteError,
    hash_files,
    list_files,
    sampled_blocks,
    verify_manifest,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
run: {output_dir: OUT, seed: 7}
model: {name: llama-debug}
data: {seq_length: 64}
optimizer: {lr: 0.001}
scheduler: {warmup_steps: 3}
training: {steps: 12, micro_batch_size: 2, global_batch_size: 4, threads: 1, sample_tokens: 0}
checkpoint: {interval: 4, keep_last: 0}
logging: {interval: 1, progress: false, tensorboard: false}
"""

#: SIGKILLs this process while its background thread writes the model file of the step-8 checkpoint (after three
#: of its items), then runs the CLI as usual. A write on the main thread (a synchronous save) is never killed.
KILLER = textwrap.dedent(
    """
    import os, signal, sys, threading
    import torch.distributed.checkpoint.filesystem as filesystem
    from loongforge.cli import main

    real_write_item = filesystem._write_item
    written = []

    def write_item(transforms, stream, *args, **kwargs):
        background = threading.current_thread() is not threading.main_thread()
        if background and ".tmp-step-0000008" in getattr(stream, "name", ""):
            written.append(1)
            if len(written) > 3:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_write_item(transforms, stream, *args, **kwargs)

    filesystem._write_item = write_item
    sys.exit(main(sys.argv[1:]))
    """
)


#: Slows every background write of a model file item by 20 ms, so that each save's write spans several training
#: steps, and prints ``OVERLAP`` for each step that ended while one was being written (then runs the CLI).
SLOW_WRITER = textwrap.dedent(
    """
    import sys, threading, time
    import torch.distributed.checkpoint.filesystem as filesystem
    from loongforge import get_host, hookimpl
    from loongforge.cli import main

    real_write_item = filesystem._write_item
    writing = threading.Event()

    def write_item(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            time.sleep(0.02)
        try:
            return real_write_item(*args, **kwargs)
        finally:
            writing.clear()

    class Overlap:
        @hookimpl
        def loongforge_on_step_end(self, step):
            if writing.is_set():
                print(f"OVERLAP {step}", flush=True)

    filesystem._write_item = write_item
    get_host().register(Overlap(), "overlap")
    sys.exit(main(sys.argv[1:]))
    """
)

#: Records, per rank, which files ``hash_files`` hashed and on which thread (one JSON line each, to HASH_LOG), then
#: runs the CLI; started by torchrun.
HASH_LOGGER = textwrap.dedent(
    """
    import json, os, sys, threading
    import loongforge.checkpoint.writer as writer
    from loongforge.cli import main

    real_hash_files = writer.hash_files

    def hash_files(root, names):
        names = list(names)
        with open(os.environ["HASH_LOG"], "a") as log:
            log.write(json.dumps({"rank": int(os.environ["RANK"]), "names": names,
                                  "main": threading.current_thread() is threading.main_thread()}) + "\\n")
        return real_hash_files(root, names)

    writer.hash_files = hash_files
    sys.exit(main(sys.argv[1:]))
    """
)


def _config(directory: Path, out: Path) -> Path:
    path = directory / f"{out.name}.yaml"
    path.write_text(CONFIG.replace("OUT", str(out)))
    return path


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=240)


def _train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = _run(["-m", "loongforge.cli", "train", str(config), *overrides])
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {name: (checkpoint / name).read_bytes() for name in list_files(checkpoint)}


def _digests(files: dict[str, bytes], *leave_out: str) -> dict[str, str]:
    """sha256 of each file's bytes (a failed comparison then names the files, not megabytes of bytes)."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items() if name not in leave_out}


def _manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / MANIFEST).read_text())


def _assert_manifest_is_complete_rehash(checkpoint: Path) -> None:
    """The merged manifest lists exactly the checkpoint's files, with what one process hashing them all finds."""
    assert _manifest(checkpoint)["files"] == hash_files(checkpoint, list_files(checkpoint))


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> tuple[Path, Path, dict[int, float]]:
    """An uninterrupted synchronous run (12 steps, a checkpoint every 4), moved from ``out/`` to ``sync/`` so that
    a background run can use the very same config file and output directory."""
    base = tmp_path_factory.mktemp("async-ckpt")
    config = _config(base, base / "out")
    _train(config)
    shutil.move(base / "out", base / "sync")
    return base, config, _losses(base / "sync")


def test_background_save_writes_the_bytes_a_synchronous_save_writes(sync_run):
    """While training goes on changing the weights and moments in place (its steps end while the files are
    written), a background save still writes what a synchronous save of that step writes."""
    base, config, reference = sync_run
    done = _run(["-c", SLOW_WRITER, "train", str(config), "checkpoint.async_save=true"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OVERLAP" in done.stdout  # training stepped during the writes
    background = base / "out"
    assert _losses(background) == reference  # saving in the background leaves training alone
    for step in (4, 8, 12):
        name = f"step-{step:07d}"
        sync, bg = _files(base / "sync" / "checkpoints" / name), _files(background / "checkpoints" / name)
        assert sorted(sync) == sorted(bg)
        assert {"model_optim/__0_0.distcp", "model_optim/.metadata", "trainer-rank00000.pt"} <= set(sync)
        # The config records the switch itself and the metadata the time of the save; everything else is equal.
        varying = ("config.yaml", "metadata.json", MANIFEST)
        assert _digests(sync, *varying) == _digests(bg, *varying)
        sync_config, bg_config = yaml.safe_load(sync["config.yaml"]), yaml.safe_load(bg["config.yaml"])
        assert (sync_config["checkpoint"].pop("async_save"), bg_config["checkpoint"].pop("async_save")) == (False, True)
        assert sync_config == bg_config
        sync_meta, bg_meta = json.loads(sync["metadata.json"]), json.loads(bg["metadata.json"])
        sync_meta.pop("saved_at"), bg_meta.pop("saved_at")
        assert sync_meta == bg_meta
        for root in (base / "sync", background):
            _assert_manifest_is_complete_rehash(root / "checkpoints" / name)
    assert (background / "checkpoints" / "latest").read_text().strip() == "step-0000012"
    assert not list((background / "checkpoints").glob(".tmp-*"))


def test_kill_during_background_write_then_resume_is_bit_exact(sync_run):
    base, _, reference = sync_run
    out = base / "killed"
    config = _config(base, out)
    killed = _run(["-c", KILLER, "train", str(config), "checkpoint.async_save=true"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = out / "checkpoints"
    half = ckpts / ".tmp-step-0000008"
    assert (ckpts / "latest").read_text().strip() == "step-0000004"  # committed before the next save began
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step-0000008", "latest", "step-0000004"]
    assert (half / "model_optim" / "__0_0.distcp").is_file() and not (half / MANIFEST).exists()
    assert sorted(_losses(out))[:8] == list(range(1, 9))

    resumed = _train(config, "checkpoint.async_save=true")
    assert f"resumed from {ckpts / 'step-0000004'} at step 4" in resumed.stdout
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 13))
    for step in range(1, 13):
        assert losses[step] == reference[step], f"step {step}: {losses[step]!r} != {reference[step]!r}"
    assert (ckpts / "latest").read_text().strip() == "step-0000012"
    assert not list(ckpts.glob(".tmp-*"))
    for step in (4, 8, 12):
        _assert_manifest_is_complete_rehash(ckpts / f"step-{step:07d}")


def test_resume_verification_level_is_the_config_s(sync_run, tmp_path):
    """``checkpoint.verify`` reaches the resume scan: with ``none`` a checkpoint with a flipped byte is loaded, with
    a warning saying what was not checked (``full``, the default, falls back past it: test_checkpoint_layout)."""
    base, _, _ = sync_run
    out = tmp_path / "out"
    shutil.copytree(base / "sync", out)
    config = _config(tmp_path, out)
    newest = out / "checkpoints" / "step-0000012"
    _flip(newest / "model_optim" / "__0_0.distcp", 1000)
    unchecked = _train(config, "checkpoint.verify=none")
    assert f"resumed from {newest} at step 12" in unchecked.stdout
    assert f"checkpoint.verify is none: only the sizes of {newest}'s files were checked" in unchecked.stderr
    with pytest.raises(CheckpointCorruptError, match="__0_0.distcp does not match its sha256"):
        verify_manifest(newest, mode="sampled")  # one block: hashed whole


@pytest.mark.distributed
def test_ranks_hash_their_own_files_into_one_complete_manifest(tmp_path):
    """dp=2 under torchrun, background saves: each rank hashes its own model and trainer files in its background
    thread (rank 0 never reads rank 1's), and the manifest rank 0 merges equals one process hashing every file."""
    out = tmp_path / "dp2"
    config = _config(tmp_path, out)
    script = tmp_path / "hash_logger.py"
    script.write_text(HASH_LOGGER)
    log = tmp_path / "hashed.jsonl"
    done = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(free_port()), str(script), "train", str(config), "training.steps=4",
                 "checkpoint.interval=2", "checkpoint.async_save=true"], HASH_LOG=str(log), OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    own = {rank: {f"model_optim/__{rank}_0.distcp", f"trainer-rank{rank:05d}.pt"} for rank in (0, 1)}
    for rank in (0, 1):
        hashed = [name for r in records if r["rank"] == rank for name in r["names"]]
        assert sorted(hashed).count(f"trainer-rank{rank:05d}.pt") == 2  # once per save, by its writer only
        assert own[rank] <= set(hashed) and not own[1 - rank] & set(hashed)
        assert all(not r["main"] for r in records if r["rank"] == rank and own[rank] & set(r["names"]))
    for step in (2, 4):
        checkpoint = out / "checkpoints" / f"step-{step:07d}"
        assert own[0] | own[1] <= set(list_files(checkpoint))
        _assert_manifest_is_complete_rehash(checkpoint)
        verify_manifest(checkpoint)


@pytest.mark.slow
@pytest.mark.needs_plugins
def test_task_engine_background_save_writes_the_bytes_a_synchronous_save_writes(tmp_path):
    """The task engine (a one-layer diffusion DiT): model, optimizer, task state, RNG and trainer files equal."""
    args = ["train", str(ROOT / "configs/diffusion-moving-squares.yaml"), f"run.output_dir={tmp_path / 'out'}",
            "model.overrides.num_layers=1", "task.samples=16", "task.sample.videos=0", "training.threads=1",
            "training.micro_batch_size=2", "logging.progress=false", "logging.tensorboard=false",
            "checkpoint.interval=2", "training.steps=4", "checkpoint.keep_last=0"]
    for extra in ((), ("checkpoint.async_save=true",)):
        done = _run(["-m", "loongforge.cli", *args, *extra])
        assert done.returncode == 0, done.stderr[-3000:]
        if not extra:
            shutil.move(tmp_path / "out", tmp_path / "sync")
    for step in (2, 4):
        name = f"checkpoints/step-{step:07d}"
        sync, bg = _files(tmp_path / "sync" / name), _files(tmp_path / "out" / name)
        assert sorted(sync) == sorted(bg) and {"model.safetensors", "optimizer.pt", "rng-0.pt"} <= set(sync)
        assert _digests(sync, "config.yaml", MANIFEST) == _digests(bg, "config.yaml", MANIFEST)
        _assert_manifest_is_complete_rehash(tmp_path / "out" / name)


# -- verification levels, on files of many blocks (no torch) ----------------------------------------------------


def _checkpoint(root: Path, blocks: int = 10) -> tuple[Path, int]:
    """A checkpoint directory with one file of ``blocks`` full blocks and a partial one, and a small file."""
    root.mkdir()
    (root / "big.bin").write_bytes(os.urandom(blocks * BLOCK_SIZE + 1234))
    (root / "small.json").write_text('{"step": 3}')
    write_manifest(root, step=3)
    return root / "big.bin", blocks + 1


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x40]))


def test_manifest_records_block_hashes_of_multi_block_files(tmp_path):
    big, count = _checkpoint(tmp_path / "c")
    entries = _manifest(tmp_path / "c")["files"]
    assert len(entries["big.bin"]["blocks"]) == count and "blocks" not in entries["small.json"]
    assert entries == hash_files(tmp_path / "c", ["big.bin", "small.json"])
    picked = sampled_blocks("big.bin", count)
    assert len(picked) == SAMPLED_BLOCKS and picked[0] == 0 and picked[-1] == count - 1
    assert picked == sampled_blocks("big.bin", count)  # the same blocks at every load


def test_a_flipped_byte_in_a_sampled_block_is_caught_by_sampled_and_full_not_none(tmp_path):
    root = tmp_path / "c"
    big, count = _checkpoint(root)
    inner = [b for b in sampled_blocks("big.bin", count) if 0 < b < count - 1][0]
    _flip(big, inner * BLOCK_SIZE + 77)
    for mode, block in (("sampled", f"block {inner} "), ("full", "")):
        with pytest.raises(CheckpointCorruptError) as info:
            verify_manifest(root, mode=mode)
        assert f"file big.bin {block}does not match its sha256" in str(info.value)
    verify_manifest(root, mode="none")  # sizes only: unnoticed


def test_a_file_of_one_block_is_hashed_whole_when_sampled(tmp_path):
    root = tmp_path / "c"
    _checkpoint(root)
    _flip(root / "small.json", 4)
    with pytest.raises(CheckpointCorruptError, match="file small.json does not match its sha256"):
        verify_manifest(root, mode="sampled")


def test_a_flipped_byte_outside_the_sample_is_missed_by_sampled_only(tmp_path):
    root = tmp_path / "c"
    big, count = _checkpoint(root)
    unsampled = next(b for b in range(count) if b not in sampled_blocks("big.bin", count))
    _flip(big, unsampled * BLOCK_SIZE + 5)
    verify_manifest(root, mode="sampled")
    with pytest.raises(CheckpointCorruptError, match="big.bin does not match its sha256"):
        verify_manifest(root, mode="full")


@pytest.mark.parametrize("mode", ["full", "sampled", "none"])
def test_a_truncated_file_is_caught_at_every_level(tmp_path, mode):
    root = tmp_path / "c"
    big, _ = _checkpoint(root)
    size = big.stat().st_size
    os.truncate(big, size - 1)
    with pytest.raises(CheckpointCorruptError, match=f"file big.bin has {size - 1} bytes, manifest says {size}"):
        verify_manifest(root, mode=mode)


def test_a_manifest_without_block_hashes_is_verified_whole_when_sampled(tmp_path):
    """A checkpoint written before block hashes existed: ``sampled`` hashes its files whole."""
    root = tmp_path / "c"
    big, count = _checkpoint(root)
    manifest = _manifest(root)
    del manifest["block_size"]
    for entry in manifest["files"].values():
        entry.pop("blocks", None)
    (root / MANIFEST).write_text(json.dumps(manifest))
    unsampled = next(b for b in range(count) if b not in sampled_blocks("big.bin", count))
    verify_manifest(root, mode="sampled")
    _flip(big, unsampled * BLOCK_SIZE + 5)
    with pytest.raises(CheckpointCorruptError, match="big.bin does not match its sha256"):
        verify_manifest(root, mode="sampled")


def test_find_checkpoint_with_none_warns_and_defaults_to_full(tmp_path, capsys):
    root = tmp_path / "c"
    big, _ = _checkpoint(root)
    _flip(big, 3)
    assert find_checkpoint(root, verify="none") == root
    assert f"checkpoint.verify is none: only the sizes of {root}'s files were checked" in capsys.readouterr().err
    with pytest.raises(CheckpointCorruptError):
        find_checkpoint(root)


def test_merged_hashes_must_name_exactly_the_directory_s_files(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    for name in ("a.bin", "b.bin"):
        (root / name).write_bytes(name.encode())
    with pytest.raises(ManifestIncompleteError, match=r"hashed by no rank: b\.bin; hashed but missing: none"):
        write_manifest(root, step=1, entries=hash_files(root, ["a.bin"]))
    entries = hash_files(root, ["a.bin", "b.bin"])
    (root / "b.bin").unlink()
    with pytest.raises(ManifestIncompleteError, match=r"hashed by no rank: none; hashed but missing: b\.bin"):
        write_manifest(root, step=1, entries=entries)
    assert not (root / MANIFEST).exists()
