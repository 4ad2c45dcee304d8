"""The encoder's own parallelism reproduces one process: heterogeneous data parallelism over the decoder's TP ranks
(``model.encoder.data_parallel_over_tp``) and tensor parallelism inside the Qwen ViT (``model.encoder.tp``).

Every layout trains the shipped VLM recipe (``configs/vlm-shapes.yaml``) for 10 steps through core's trainer; the
losses must equal the one-process run's within 1e-5 relative. All layouts of one world size share one torchrun
launch (this file is its worker), which also records the patches each rank's encoder embedded: under heterogeneous
DP every patch is encoded exactly once across the TP group, each rank about half of them at tp 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge import hookimpl, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm-shapes.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
         "scheduler.warmup_steps=2", "checkpoint.save_at_end=false", "training.steps=10"]
QWEN = ["model.projector=patch-merger"]
SPLIT = "data_parallel_over_tp: true"

#: name -> (overrides of the one-process reference, extra overrides of the parallel layout), per world size.
LAYOUTS = {
    2: {
        "siglip-split": (["model.encoder={name: siglip-tiny, %s}" % SPLIT], ["parallel.tp=2"]),
        "qwen-split": (["model.encoder={name: qwen2-vl-vit-tiny, %s}" % SPLIT, *QWEN], ["parallel.tp=2"]),
    },
}


class EncoderWork:
    """Counts the patches this rank's encoder embeds over the run (a pre-hook on its patch embedding)."""

    patches = 0

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        encoder = trainer.model[0].module.encoder

        def count(_module, args):
            self.patches += args[0].numel() // args[0].shape[-1]

        encoder.patch_embed.register_forward_pre_hook(count)


def _config(out: Path, overrides: list[str]):
    return load_config(CONFIG, [f"run.output_dir={out}", *QUIET, *overrides])


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _worker(out: Path, world: int) -> None:
    import torch.distributed as dist
    from loongforge.plugins import get_host
    from loongforge.train.run import run_training

    dist.init_process_group("gloo")  # the trainer reuses it, so one launch trains every layout
    host = get_host()
    for name, (reference, layout) in LAYOUTS[world].items():
        work = EncoderWork()
        host.register(work, "encoder-work")
        try:
            run_training(_config(out / name, [*reference, *layout]))
        finally:
            host.unregister("encoder-work")
        (out / name / f"patches-rank{dist.get_rank()}.json").write_text(json.dumps(work.patches))
    dist.destroy_process_group()


def _launch(out: Path, world: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__,
           str(out), str(world)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_encoder_parallel_layouts_match_one_process(tmp_path, register_plugin, world):
    from loongforge.train.run import run_training

    _launch(tmp_path / "parallel", world)
    for name, (reference, _) in LAYOUTS[world].items():
        work = register_plugin(EncoderWork(), f"encoder-work-{name}")
        run_training(_config(tmp_path / "single" / name, reference))
        single, parallel = _losses(tmp_path / "single" / name), _losses(tmp_path / "parallel" / name)
        assert len(single) == len(parallel) == 10 and single[-1] < single[0], (name, single)
        worst = max(abs(p - s) / s for s, p in zip(single, parallel, strict=True))
        print(f"{name}: worst loss rel {worst:.2e}; one process {single}")
        assert worst <= 1e-5, (name, single, parallel)
        patches = [json.loads((tmp_path / "parallel" / name / f"patches-rank{r}.json").read_text())
                   for r in range(world)]
        print(f"{name}: patches encoded per rank {patches}, one process {work.patches}")
        if name.endswith("split"):  # tp 2, dp 1: the two ranks share the images, each encodes about half
            assert sum(patches) == work.patches and max(patches) <= 0.6 * work.patches, (patches, work.patches)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
