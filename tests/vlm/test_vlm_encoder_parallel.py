"""The encoder's own parallelism reproduces one process: heterogeneous data parallelism over the decoder's TP ranks
(``model.encoder.data_parallel_over_tp``) and tensor parallelism inside the Qwen ViT (``model.encoder.tp``).

Every layout trains the shipped VLM recipe (``configs/vlm-shapes.yaml``) for 10 steps through core's trainer; the
losses must equal the one-process run's within 1e-5 relative. All layouts of one world size share one torchrun
launch (this file is its worker), which also records the patches each rank's encoder embedded: under heterogeneous
DP every patch is encoded exactly once across the TP group, each rank about half of them at tp 2. The planner's
numbers for both and the options' checks are unit tests here (no processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge import hookimpl, load_config
from loongforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm-shapes.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
         "scheduler.warmup_steps=2", "checkpoint.save_at_end=false", "training.steps=10"]
QWEN = ["model.projector=patch-merger"]
SIGLIP_SPLIT = "model.encoder={name: siglip-tiny, data_parallel_over_tp: true}"
QWEN_SPLIT = "model.encoder={name: qwen2-vl-vit-tiny, data_parallel_over_tp: true}"
# Qwen2.5-VL's ViT: SwiGLU fc1 ([gate; up] split block by block) and windowed blocks
QWEN_TP = "model.encoder={name: qwen2.5-vl-vit-tiny, tp: 2}"
SAVE = ["checkpoint.save_at_end=true"]

#: name -> (the model's overrides, the parallel layout's), per world size; the one-process reference runs the model's
#: overrides alone (at parallel.tp 1 both encoder options leave the encoder whole and unsplit).
LAYOUTS = {
    2: {
        "siglip-split": ([SIGLIP_SPLIT], ["parallel.tp=2"]),
        "qwen-split": ([QWEN_SPLIT, *QWEN], ["parallel.tp=2"]),
        "qwen-tp": ([QWEN_TP, *QWEN, *SAVE], ["parallel.tp=2"]),  # saved: read back at tp 1
    },
    4: {  # four ranks share four images; and encoder tp 2 beside data parallelism 2
        "siglip-split-tp4": ([SIGLIP_SPLIT], ["parallel.tp=4"]),
        "qwen-tp-dp2": ([QWEN_TP, *QWEN, "training.global_batch_size=8"], ["parallel.tp=2"]),
    },
}


class EncoderWork:
    """Counts the patches this rank's encoder embeds over the run (a pre-hook on its patch embedding) and notes the
    rows of its first fused ``qkv`` weight (a third of them at encoder tp 2)."""

    patches = 0

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        encoder = trainer.model[0].module.encoder
        self.qkv_rows = encoder.blocks[0].attn.qkv.weight.shape[0]

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
        (out / name / f"work-rank{dist.get_rank()}.json").write_text(json.dumps([work.patches, work.qkv_rows]))
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
        patches, qkv_rows = zip(*(json.loads((tmp_path / "parallel" / name / f"work-rank{r}.json").read_text())
                                  for r in range(world)), strict=True)
        print(f"{name}: patches encoded per rank {patches}, one process {work.patches}")
        split_heads = "tp: 2" in reference[0]
        assert set(qkv_rows) == {work.qkv_rows // 2 if split_heads else work.qkv_rows}, (qkv_rows, work.qkv_rows)
        if "split" in name:  # dp 1: the TP ranks share the images out, each encodes about 1/tp of them
            assert sum(patches) == work.patches and max(patches) <= 1.2 * work.patches / world, (patches, work.patches)
        if "checkpoint.save_at_end=true" in reference:
            _check_encoder_checkpoints(tmp_path / "single" / name, tmp_path / "parallel" / name)


def _check_encoder_checkpoints(single: Path, parallel: Path) -> None:
    """The encoder saved at encoder tp 2 loads into a one-process model (tp 1) and equals the one-process run's."""
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop import mcore_checkpoint
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    states = []
    for run in (single, parallel):
        path = find_checkpoint(run / "checkpoints")
        flavor = mcore_checkpoint.resolve_family(mcore_checkpoint.checkpoint_config(path))
        with standalone_world() as backend:
            model = build_standalone(flavor, backend, "fp32")
            mcore_checkpoint.load_model_weights(path, [model])
        states.append({n: t for n, t in model.encoder.state_dict().items() if "blocks." in n})
    assert states[0]["blocks.0.attn.qkv.weight"].shape == states[1]["blocks.0.attn.qkv.weight"].shape
    worst = max(((states[1][n] - t).norm() / t.norm()).item() for n, t in states[0].items())
    assert worst <= 1e-4, worst


def _vision_part(**options):
    from loongforge.config.schema import LoongForgeConfig
    from loongforge_vlm.model.flavors import FLAVORS
    from loongforge_vlm.model.part_options import PartOptions

    config = LoongForgeConfig()
    config.data.seq_length = 128
    flavor = FLAVORS["qwen2-vl-tiny"].with_overrides(vision_tokens_per_sample=16,
                                                    part_options=(("encoder", PartOptions(**options)),))
    return flavor.planner_parts(config)[0]


def test_planner_divides_the_encoder_over_tp_by_hand():
    """qwen2-vl-tiny's ViT (d32, f128 QuickGELU, 2 blocks, merger 128->48) with 16 vision tokens = 64 patches, at tp 2
    (test_vlm_planner.py derives the replicated numbers: 51,248 params, 104,448 activation elements and 5,308,416
    forward FLOPs per sample)."""
    from loongforge.planner.layouts import Candidate
    from loongforge.planner.memory import Workload
    from loongforge_vlm.model.flavors import FLAVORS

    cand = Candidate(tp=2, pp=1, dp=1, micro_batch_size=2)
    workload = Workload(FLAVORS["qwen2-vl-tiny"].foundation, 128, "fp32")
    replicated, images, heads = _vision_part(), _vision_part(data_parallel_over_tp=True), _vision_part(tp=2)
    assert replicated.rank_flops_per_sample(workload, cand) == 3 * 5308416
    assert "params replicated over tp," in replicated.description
    # heterogeneous DP: each rank encodes half of the images -- half the compute and activations, all the weights
    assert images.rank_flops_per_sample(workload, cand) == 3 * 5308416 / 2
    assert images.activation_bytes(cand, 256, workload) == 104448 * 2 * 4 / 2 and images.param_count(cand) == 51248
    assert images.flops_per_sample(workload) == 3 * 5308416  # what the model costs (MFU) does not change
    # encoder tp: per block qkv (32x96 + 96), out 32x32, fc1 (32x128 + 128), fc2 128x32 are halved
    split_params = 2 * ((32 * 96 + 96) + 32 * 32 + (32 * 128 + 128) + 128 * 32)
    assert heads.param_count(cand) == 51248 - split_params // 2 == 38736
    # whole on every rank: patch embedding 64 x 2 x 96 x 32 and the merger 16 x 2 x (128x128 + 128x48); the blocks'
    # matmuls 64 x 2 x 2 x 12288 and attention 64 x 2 x 4 x 64 x 32 are halved
    whole, split = 64 * 2 * 96 * 32 + 16 * 2 * (128 * 128 + 128 * 48), 64 * (2 * 2 * 12288 + 2 * 4 * 64 * 32)
    assert whole + split == 5308416
    assert heads.rank_flops_per_sample(workload, cand) == 3 * (whole + split / 2) == 9633792
    # activations per patch: 2 blocks x (norms 4d + (attention 6d + QuickGELU 3f) / 2) + patch input 96 + merger 4d
    assert heads.activation_bytes(cand, 256, workload) == (2 * (4 * 32 + (6 * 32 + 3 * 128) / 2) + 96 + 4 * 32) * 64 \
        * 2 * 4
    assert "split over tp (encoder tp)" in heads.description


def test_encoder_parallel_options_are_checked():
    from loongforge.parallel.megatron import Layout
    from loongforge_vlm.model.flavors import FLAVORS
    from loongforge_vlm.model.part_options import PartOptions, split_options

    def layout(tp):
        return Layout(tp=tp, pp=1, dp=1, sequence_parallel=False, distributed_optimizer=False)

    qwen = FLAVORS["qwen2-vl-tiny"].with_overrides(part_options=(("encoder", PartOptions(tp=2)),))
    assert qwen.check_layout(layout(2)) == [] and qwen.check_layout(layout(1)) == []
    problems = [problem.message for problem in qwen.check_layout(layout(4))]  # the decoder's own problem first
    assert problems[-1].startswith("model.encoder.tp=2 must be 1 or parallel.tp (4)"), problems
    siglip = FLAVORS["vlm-tiny"].with_overrides(part_options=(("encoder", PartOptions(tp=2)),))
    (problem,) = siglip.check_layout(layout(2))
    assert "only a Qwen ViT encoder splits" in problem.message
    with pytest.raises(ConfigError, match="model.foundation.tp: an encoder option"):
        split_options("foundation", {"name": "qwen3-tiny", "tp": 2}, "run.yaml")
    with pytest.raises(ConfigError, match="exclude each other"):
        split_options("encoder", {"tp": 2, "data_parallel_over_tp": True}, "run.yaml")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
