"""Training samples/s of LoongForge's policy loop vs LeRobot 0.4.4's ``lerobot-train`` loop, same tiny Pi0.5.

Both sides train the PaliGemma-exact Pi0.5 at the sizes of ``parity/lerobot/reference.py``'s ``TinySizes`` (one
camera; LeRobot's vocabulary of 257152 ids and 8 query heads), float32, on the CPU, from the same LeRobot v3.0
dataset written by our writer (the synthetic reach set of :mod:`loongforge_embodied.policies.reach`), with the
same batch size, AdamW settings (LeRobot's Pi0.5 preset: betas 0.9/0.95, eps 1e-8, weight decay 0.01), gradient
clipping at 1.0, quantile normalisation of state and actions and the same prompt length.

- **LeRobot**: what ``lerobot/scripts/lerobot_train.py`` runs per step, with its own pieces:
  ``make_dataset``'s ``LeRobotDataset`` (delta timestamps from the policy config) in their ``DataLoader``
  (shuffle, ``drop_last=False``) prepared by ``accelerate.Accelerator(cpu=True)`` and ``cycle``d, the Pi0.5
  preprocessor of ``make_pre_post_processors`` (rename, batch, normaliser, state-to-prompt step, tokenizer,
  device), and ``update_policy`` (``PI05Policy.forward``, backward, clip, AdamW, cosine-with-warmup scheduler)
  on ``make_policy``'s ``PI05Policy``. Its weights are the reference builder's seeded ones.
- **LoongForge**: ``loongforge train``'s task path in process: the config is loaded by
  ``load_config``, the model and its task come from the plugin registry (``pi05-gemma-tiny`` with the reference's
  sizes as overrides), and ``TaskEngine.train_step`` runs each step (batch order, collate, flow-matching loss,
  backward, clip, AdamW). Its weights are LeRobot's, converted by ``convert_lerobot``.

Differences that cannot be removed (documented, not hidden):

- The tokenizer: LeRobot tokenizes its prompt string (``"Task: ..., State: <bins>;\\nAction: "``) with PaliGemma's
  SentencePiece tokenizer, which is not on a package registry. Here its ``TokenizerProcessorStep`` is given an
  offline byte-level tokenizer (UTF-8 bytes + 1, padded/cut to ``tokenizer_max_length``); ours writes task bytes then
  state bins. Both prompts have ``text_len + max_state_dim`` ids, so the model does the same work.
- Data: LeRobot decodes each frame (parquet row, PNG image, action window), normalises and tokenizes every step
  (``--lerobot-workers`` DataLoader workers, default 0 so both sides use the same threads); ours decodes and
  normalises the (small) training split once when the dataset is built and collates tensors per step. The report
  splits each side's step into data and update time.
- LeRobot averages the loss over every chunk step; ours masks padded steps (``action_is_pad``): a few element-wise ops.
- LeRobot's optimizer also holds the two unused ``lm_head`` weights and the last layer's unused prefix modules;
  of these only the last layer's prefix ``q_proj`` (8,192 of ~16.6M parameters at these sizes) gets a gradient
  (all zeros: its queries feed outputs nothing reads) and an AdamW update. Ours freezes them. The report prints
  the parameters each side's AdamW updates.
- The vocabulary (257152 x width 64 = 16.5M of the 16.6M parameters, hard-coded by LeRobot) makes the dense
  embedding gradient and its AdamW update most of a step at these sizes. LeRobot's AdamW is PyTorch's default
  (foreach) update; our task loop uses PyTorch's fused AdamW kernel wherever it applies (same arithmetic up to
  float rounding; ``loongforge.train.engines.task.fused_adamw_applies``). Measured on 2 shared CPU cores, 1 thread,
  batch 8: 3.33x with it (optimizer 32 vs 269 ms per step), 1.13x without (the update dominated both sides).

Steps alternate in rounds (``--rounds`` x ``--steps`` each, the order flipped every round) after ``--warmup`` steps
of each, in one process, with ``torch.set_num_threads(--threads)``; then ``--phase-steps`` more steps per side are
timed phase by phase (data, forward, backward, clip, optimizer). Prints a table and writes ``--out`` (JSON).
Targets: median ratio ours / LeRobot >= 1.2 on CPU (issue 8), kept >= 2 (issue 21). Runs in the ``bench_lerobot``
nox session (LeRobot needs transformers 4.x; see parity/lerobot/README.md)::

    nox -s bench_lerobot -- --steps 20 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity" / "lerobot"))

import torch  # noqa: E402
import yaml  # noqa: E402
from reference import TinySizes, build_reference  # noqa: E402

REPO_ID = "local/reach"
#: LeRobot's Pi0.5 optimizer preset, used on both sides (the learning rate only shapes the numbers, not the time).
LR, BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = 2.5e-5, (0.9, 0.95), 1e-8, 0.01, 1.0


@dataclass
class Timings:
    """Per-step wall times of one side in one round: the whole step, and its data part (batch fetch,
    preprocessing, collate)."""

    step_s: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)

    def samples_per_s(self, batch: int) -> float:
        return batch * len(self.step_s) / sum(self.step_s)


def _updated(optimizer: torch.optim.Optimizer) -> int:
    return sum(param.numel() for param, state in optimizer.state.items() if state)


class Stopwatch:
    """Wall time of consecutive phases of one step: ``lap(name)`` closes the phase that ran since the last lap."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name], self._last = now - self._last, now


class ByteTokenizer:
    """An offline stand-in for PaliGemma's tokenizer with the call ``TokenizerProcessorStep`` makes: UTF-8 bytes
    + 1 (0 pads), right-padded or cut to ``max_length``."""

    def __call__(self, texts: list[str], *, max_length: int, truncation: bool, padding: str, padding_side: str,
                 return_tensors: str) -> dict[str, torch.Tensor]:
        ids = torch.zeros(len(texts), max_length, dtype=torch.long)
        for row, text in enumerate(texts):
            data = list(text.encode("utf-8"))[:max_length]
            ids[row, :len(data)] = torch.tensor(data, dtype=torch.long) + 1
        return {"input_ids": ids, "attention_mask": ids != 0}


class OfflineAutoTokenizer:
    """What ``TokenizerProcessorStep`` gets for ``AutoTokenizer`` while the preprocessor is built."""

    @staticmethod
    def from_pretrained(name: str) -> ByteTokenizer:
        return ByteTokenizer()


# -- LeRobot's loop ------------------------------------------------------------------------------------------------
class LeRobotLoop:
    """``lerobot_train.train``'s setup and per-step body (without logging, checkpoints and evaluation)."""

    def __init__(self, root: Path, sizes: TinySizes, batch: int, steps: int, workers: int) -> None:
        from accelerate import Accelerator
        from lerobot.datasets.factory import resolve_delta_timestamps
        from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata
        from lerobot.datasets.utils import cycle
        from lerobot.optim.optimizers import AdamWConfig
        from lerobot.optim.schedulers import CosineDecayWithWarmupSchedulerConfig
        from lerobot.policies.factory import make_policy, make_pre_post_processors
        from lerobot.policies.pi05.configuration_pi05 import PI05Config
        from lerobot.processor import tokenizer_processor
        from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

        reference = build_reference(sizes, seed=0)  # a PI05Policy; also makes modeling_pi05 build these sizes
        self.accelerator = Accelerator(step_scheduler_with_optimizer=False, cpu=True)
        config = PI05Config(dtype="float32", chunk_size=sizes.chunk_size, n_action_steps=sizes.chunk_size,
                            max_state_dim=sizes.max_state_dim, max_action_dim=sizes.max_action_dim,
                            image_resolution=(sizes.image_size, sizes.image_size), device="cpu",
                            tokenizer_max_length=sizes.text_len + sizes.max_state_dim, optimizer_lr=LR,
                            optimizer_betas=BETAS, optimizer_eps=EPS, optimizer_weight_decay=WEIGHT_DECAY,
                            optimizer_grad_clip_norm=GRAD_CLIP)
        meta = LeRobotDatasetMetadata(REPO_ID, root=root)
        dataset = LeRobotDataset(REPO_ID, root=root, delta_timestamps=resolve_delta_timestamps(config, meta))
        self.policy = make_policy(cfg=config, ds_meta=meta)
        self.policy.load_state_dict(reference.state_dict())
        # PaliGemma's tokenizer cannot be downloaded: the tokenizer step loads ours instead (module docstring).
        with mock.patch.object(tokenizer_processor, "AutoTokenizer", OfflineAutoTokenizer):
            self.preprocessor, _ = make_pre_post_processors(policy_cfg=config, dataset_stats=meta.stats)
        self.optimizer = AdamWConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                     grad_clip_norm=GRAD_CLIP).build(self.policy.get_optim_params())
        self.scheduler = CosineDecayWithWarmupSchedulerConfig(
            num_warmup_steps=config.scheduler_warmup_steps, num_decay_steps=config.scheduler_decay_steps,
            peak_lr=LR, decay_lr=config.scheduler_decay_lr).build(self.optimizer, steps)
        loader = torch.utils.data.DataLoader(dataset, num_workers=workers, batch_size=batch, shuffle=True,
                                             pin_memory=False, drop_last=False,
                                             prefetch_factor=2 if workers > 0 else None)
        self.policy, self.optimizer, loader, self.scheduler = self.accelerator.prepare(
            self.policy, self.optimizer, loader, self.scheduler)
        self.batches = cycle(loader)
        meters = {name: AverageMeter(name, ":.3f") for name in ("loss", "grad_norm", "lr", "update_s",
                                                                 "dataloading_s")}
        self.tracker = MetricsTracker(batch, dataset.num_frames, dataset.num_episodes, meters,
                                      accelerator=self.accelerator)
        self.policy.train()

    def step(self, timings: Timings) -> float:
        from lerobot.scripts.lerobot_train import update_policy

        start = time.perf_counter()
        batch = self.preprocessor(next(self.batches))
        loaded = time.perf_counter()
        self.tracker, _ = update_policy(self.tracker, self.policy, batch, self.optimizer, GRAD_CLIP,
                                        accelerator=self.accelerator, lr_scheduler=self.scheduler)
        self.tracker.step()
        timings.data_s.append(loaded - start)
        timings.step_s.append(time.perf_counter() - start)
        return float(self.tracker.loss.val)

    def updated_params(self) -> int:
        """Parameters AdamW has state for (those that got gradients): the work both sides must share."""
        return _updated(getattr(self.optimizer, "optimizer", self.optimizer))  # accelerate wraps it

    def phases(self) -> dict[str, float]:
        """One step of ``update_policy``'s work, timed phase by phase (its body, written out between laps)."""
        watch = Stopwatch()
        batch = self.preprocessor(next(self.batches))
        watch.lap("data")
        loss, _ = self.policy.forward(batch)
        watch.lap("forward")
        self.accelerator.backward(loss)
        watch.lap("backward")
        self.accelerator.clip_grad_norm_(self.policy.parameters(), GRAD_CLIP)
        watch.lap("clip")
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        watch.lap("optimizer")
        return watch.times


# -- our loop ------------------------------------------------------------------------------------------------------
def our_config(root: Path, sizes: TinySizes, batch: int, steps: int, threads: int, out: Path) -> Path:
    """A ``loongforge train`` config for ``pi05-gemma-tiny`` at ``sizes``, reading ``root``."""
    from loongforge_embodied.policies.pi05_gemma_flavors import Pi05GemmaFlavor

    sized = {f.name for f in fields(Pi05GemmaFlavor)}
    overrides = {f.name: getattr(sizes, f.name) for f in fields(sizes) if f.name in sized}
    config = {
        "run": {"name": "bench-embodied-vs-lerobot", "output_dir": str(out / "run"), "seed": 0},
        "device": "cpu",
        "model": {"name": "pi05-gemma-tiny", "overrides": overrides},
        "optimizer": {"lr": LR, "min_lr": 2.5e-6, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
                      "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP},
        "scheduler": {"warmup_steps": 1000, "decay": "cosine"},
        "training": {"steps": steps, "micro_batch_size": batch, "precision": "fp32", "threads": threads},
        "checkpoint": {"interval": 0},
        "task": {"data": str(root), "held_out_episodes": 0, "action_horizon": sizes.chunk_size,
                 "normalization": "quantiles", "eval": {"frames": 0}},
    }
    path = out / "ours.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class OurLoop:
    """``loongforge train``'s task path (``train/run.py`` -> ``engines.task.TaskEngine``) without the loop's
    logging, schedule and checkpoints: config, registry, task and engine as the CLI builds them; one ``train_step``
    per step (at the constant ``optimizer.lr``)."""

    def __init__(self, config_path: Path, weights: dict[str, torch.Tensor]) -> None:
        from loongforge.config.loader import load_config
        from loongforge.devices.selection import select_backend
        from loongforge.plugins import get_host
        from loongforge.resolve import registered_family
        from loongforge.train.engines import task as task_engine
        from loongforge_embodied.convert_lerobot import from_lerobot

        config = load_config(config_path)
        host = get_host()
        host.configure(config)
        backend, _ = select_backend("cpu", host.registry("device"), source="benchmark")
        task = registered_family(config, host).make_task(config)
        self.trainer = task_engine.TaskEngine(config, task, backend, host)
        state, _ = from_lerobot(weights, task.flavor)
        self.trainer.model.load_state_dict(state, strict=True)
        self._collate, self._collate_s = task_engine._collate, 0.0
        task_engine._collate = self._timed_collate  # measure the data part of train_step without changing it

    def _timed_collate(self, *args: Any) -> Any:
        start = time.perf_counter()
        batch = self._collate(*args)
        self._collate_s += time.perf_counter() - start
        return batch

    def step(self, timings: Timings) -> float:
        self._collate_s = 0.0
        start = time.perf_counter()
        result = self.trainer.train_step()
        timings.step_s.append(time.perf_counter() - start)
        timings.data_s.append(self._collate_s)
        return result.loss

    def updated_params(self) -> int:
        return _updated(self.trainer.optimizer)

    def phases(self) -> dict[str, float]:
        """One step of ``TaskEngine.train_step``'s work, timed phase by phase (its body, written out between laps;
        the learning rate stays where the timed steps left it)."""
        t, watch = self.trainer, Stopwatch()
        indices = t.order.next()[:t.config.training.micro_batch_size]
        batch = self._collate([t.data[i] for i in indices], indices, t.device)
        watch.lap("data")
        loss = t.task.training_step(t.model, batch)
        watch.lap("forward")
        t.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        watch.lap("backward")
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.config.optimizer.grad_clip)
        watch.lap("clip")
        t.optimizer.step()
        watch.lap("optimizer")
        return watch.times


# -- the run -------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from loongforge_embodied.policies.reach import write_reach_dataset

    torch.set_num_threads(args.threads)
    sizes = replace(TinySizes(), cameras=1, action_dim=2)  # the reach set: one camera, 2-d actions
    out = Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    root = write_reach_dataset(out / "reach", episodes=args.episodes, length=args.length,
                               image_size=sizes.image_size, seed=0)
    total = args.warmup + args.rounds * args.steps
    setup = time.perf_counter()
    theirs = LeRobotLoop(root, sizes, args.batch, total, args.lerobot_workers)
    weights = theirs.accelerator.unwrap_model(theirs.policy).state_dict()
    ours = OurLoop(our_config(root, sizes, args.batch, total, args.threads, out), weights)
    torch.set_num_threads(args.threads)  # after every library had its say
    setup = time.perf_counter() - setup
    loops = {"lerobot": theirs, "ours": ours}
    losses = {name: [loop.step(Timings()) for _ in range(args.warmup)] for name, loop in loops.items()}
    rounds, all_steps = [], {name: [] for name in loops}
    for index in range(args.rounds):
        order = list(loops) if index % 2 == 0 else list(loops)[::-1]
        timed = {name: Timings() for name in loops}
        for name in order:
            losses[name] += [loops[name].step(timed[name]) for _ in range(args.steps)]
        rounds.append({name: {"samples_per_s": t.samples_per_s(args.batch),
                              "step_ms": 1e3 * statistics.median(t.step_s),
                              "data_ms": 1e3 * statistics.median(t.data_s)} for name, t in timed.items()})
        rounds[-1]["ratio"] = rounds[-1]["ours"]["samples_per_s"] / rounds[-1]["lerobot"]["samples_per_s"]
        for name, t in timed.items():
            all_steps[name] += t.step_s
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in loops}
    for _ in range(args.phase_steps):  # alternating step by step, like the rounds
        for name, loop in loops.items():
            phases[name].append(loop.phases())
    return {"sizes": asdict(sizes), "batch": args.batch, "threads": torch.get_num_threads(),
            "steps_per_round": args.steps, "warmup": args.warmup, "phase_steps": args.phase_steps,
            "lerobot_workers": args.lerobot_workers,
            "updated_params": {name: loop.updated_params() for name, loop in loops.items()},
            "frames": args.episodes * args.length, "setup_s": setup, "torch": torch.__version__,
            "rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
            # robust to bursts of load from other processes: the ratio of the median step times of all rounds
            "median_step_ratio": statistics.median(all_steps["lerobot"]) / statistics.median(all_steps["ours"]),
            "first_losses": {name: values[:3] for name, values in losses.items()},
            "phases_ms": {name: {key: 1e3 * statistics.median(p[key] for p in rows) for key in rows[0]}
                          for name, rows in phases.items() if rows}}


def report(result: dict[str, Any]) -> str:
    lines = [f"{'round':>5} | {'LeRobot samples/s':>17} {'step ms':>8} {'data ms':>8} | "
             f"{'ours samples/s':>14} {'step ms':>8} {'data ms':>8} | {'ours/LeRobot':>12}"]
    for index, r in enumerate(result["rounds"]):
        a, b = r["lerobot"], r["ours"]
        lines.append(f"{index:>5} | {a['samples_per_s']:>17.1f} {a['step_ms']:>8.1f} {a['data_ms']:>8.2f} | "
                     f"{b['samples_per_s']:>14.1f} {b['step_ms']:>8.1f} {b['data_ms']:>8.2f} | {r['ratio']:>12.2f}")
    lines.append(f"median ratio ours/LeRobot: {result['median_ratio']:.2f} (target >= 2; batch {result['batch']}, "
                 f"{result['threads']} thread(s), {result['steps_per_round']} steps/round); ratio of median step "
                 f"times: {result['median_step_ratio']:.2f}")
    lines.append("parameters updated per step: " + ", ".join(f"{name} {count:,}"
                                                           for name, count in result["updated_params"].items()))
    for name, phases in result["phases_ms"].items():
        lines.append(f"{name} step phases (median ms of {result['phase_steps']}): "
                     + ", ".join(f"{key} {value:.1f}" for key, value in phases.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument("--phase-steps", type=int, default=5, help="steps per side timed phase by phase, after")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--lerobot-workers", type=int, default=0, help="LeRobot DataLoader workers (theirs: 4)")
    parser.add_argument("--workdir", default="runs/bench-embodied-vs-lerobot", help="the dataset and our run")
    parser.add_argument("--out", default="runs/bench-embodied-vs-lerobot/result.json")
    args = parser.parse_args()
    result = run(args)
    print(report(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
