"""``dp-balance`` on loongforge-vlm's image-text data path, and the loss normalisation it needs.

- ``training.loss_normalization: global_tokens`` (megatron's per-token loss): one micro-batch on one process trains
  as the per-micro-batch mean does, and splitting a step into more micro-batches changes nothing;
- the data path: a balancer that keeps each rank's samples gives the plain batches bit for bit, one that moves them
  gets them re-packed into the same rows, one that hands a rank more than its rows hold stops the run in one line;
- on 2 gloo ranks the samples trained per step are the same multiset with and without balancing, a plan some rank's
  rows cannot hold keeps the sampler's placement (and is counted), and through
  ``loongforge train --nproc 2`` the balanced run's loss and grad norm equal the plain run's (both global_tokens)
  while its predicted max/mean rank load is lower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from loongforge import load_config
from loongforge.data.errors import DataError
from loongforge.data.sampler import TrainBatchIterator
from loongforge.errors import ConfigError

pytestmark = pytest.mark.needs_plugins

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm-shapes.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
         "scheduler.warmup_steps=2", "checkpoint.save_at_end=false"]
COST = "{a: 0.001, b: 1.0, c: 10.0}"  # pinned: no warm-up steps


def _rows(pack: bool = True):
    """The training rows of configs/vlm-shapes.yaml at seq_length 96, built as a run builds them."""
    from loongforge.plugins import PluginHost
    from loongforge.resolve import resolve_model_flavor
    from loongforge.train.batches import load_tokenizer

    config = load_config(CONFIG, ["data.seq_length=96", f"data.pack={str(pack).lower()}"])
    host = PluginHost()
    dataset = host.registry("dataset").load(config.data.dataset)(
        [], load_tokenizer(host, config), model=resolve_model_flavor(config, host))
    return dataset.split_samples(config.data)[0]


@pytest.fixture(scope="module")
def rows():
    return _rows()


def _balanced(rows, balance, steps=3, mbs=2, micro_batches=2):
    from loongforge_vlm.data.balanced import BalancedBatches

    balanced = BalancedBatches(rows, mbs, 0, balance=balance, num_microbatches=micro_batches)
    plain = TrainBatchIterator(rows, mbs, 0)
    pairs = [(next(balanced), next(plain)) for _ in range(steps * micro_batches)]
    return balanced, plain, pairs


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _segments(batch: dict) -> list[tuple[int, ...]]:
    """Each sample's input tokens, read back from the rows by their segment ids."""
    out = []
    for tokens, segments in zip(batch["tokens"], batch["segment_ids"], strict=True):
        out += [tuple(tokens[segments == k].tolist()) for k in range(int(segments.max()) + 1)]
    return out


def test_unmoved_samples_give_the_plain_batches_bit_for_bit(rows):
    balanced, plain, pairs = _balanced(rows, lambda samples: samples)
    assert all(_same(a, b) for a, b in pairs)
    assert balanced.state_dict() == plain.state_dict()
    assert balanced.dp_token_cap == 2 * 2 * 96  # micro-batches x rows x seq_length


def test_moved_samples_are_repacked_into_the_same_rows(rows):
    _, _, pairs = _balanced(rows, lambda samples: samples[::-1], steps=2)
    assert any(not _same(a, b) for a, b in pairs)  # the order changed the packing ...
    for a, b in pairs:
        assert a["tokens"].shape == b["tokens"].shape == (2, 96)
    for step in range(2):  # ... but each step trains the same samples, supervised tokens and images
        mine = pairs[2 * step: 2 * step + 2]
        ours = [s for a, _ in mine for s in _segments(a)]
        theirs = [s for _, b in mine for s in _segments(b)]
        assert sorted(ours) == sorted(theirs)
        assert sum(float(a["loss_mask"].sum()) for a, _ in mine) == sum(float(b["loss_mask"].sum()) for _, b in mine)
        assert sum(len(a.get("pixel_values", ())) for a, _ in mine) == sum(len(b.get("pixel_values", ()))
                                                                          for _, b in mine)


def test_resuming_between_steps_continues_the_same_batches(rows):
    from loongforge_vlm.data.balanced import BalancedBatches

    def reorder(samples):
        return samples[::-1]

    first = BalancedBatches(rows, 2, 0, balance=reorder, num_microbatches=2)
    next(first)
    with pytest.raises(RuntimeError, match="middle of a step"):
        first.state_dict()
    next(first)
    resumed = BalancedBatches(rows, 2, 0, balance=reorder, num_microbatches=2)
    resumed.load_state_dict(first.state_dict())
    assert all(_same(next(first), next(resumed)) for _ in range(4))


def test_more_samples_than_the_rows_hold_stop_the_run_in_one_line(rows):
    from loongforge_vlm.data.balanced import BalancedBatches

    balanced = BalancedBatches(rows, 2, 0, balance=lambda samples: samples * 3, num_microbatches=2)
    assert balanced.dp_fits([96] * 4) and not balanced.dp_fits([96] * 5) and not balanced.dp_fits([50] * 5)
    with pytest.raises(DataError, match=r"^data-parallel rank 0 was given \d+ samples of \d+ tokens that its 4 rows "
                                        r"of 96 tokens cannot hold \(the balancer must respect dp_fits\)$"):
        next(balanced)


def test_unpacked_rows_are_refused():
    with pytest.raises(DataError, match=r"needs data.pack: true"):
        _rows(pack=False).balanced_batches(lambda s: s, micro_batch_size=2, num_microbatches=1, seed=0, dp_rank=0,
                                           dp_size=1)


def _config(out: Path, *overrides: str):
    return load_config(CONFIG, [f"run.output_dir={out}", *QUIET, *overrides])


def test_dp_balance_needs_global_tokens_in_one_line(tmp_path):
    from loongforge.train.run import run_training

    with pytest.raises(ConfigError) as caught:
        run_training(_config(tmp_path, "training.steps=1", f"optimizations.dp-balance.cost={COST}"))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{CONFIG}: optimizations.dp-balance needs "
                                                      "training.loss_normalization: global_tokens (got 'micro_batch')")


def test_unknown_loss_normalization_is_refused(tmp_path):
    from loongforge.train.run import run_training

    with pytest.raises(ConfigError, match=r"training.loss_normalization must be one of micro_batch, global_tokens, "
                                          r"got 'per_sample'"):
        run_training(_config(tmp_path, "training.steps=1", "training.loss_normalization=per_sample"))


def _curves(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _close(a: dict[int, dict], b: dict[int, dict], key: str) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[s][key] - b[s][key]) / abs(b[s][key]) for s in a)


def test_global_tokens_is_the_per_token_mean_and_ignores_micro_batch_splits(tmp_path):
    from loongforge.train.run import run_training

    def train(name: str, *extra: str) -> dict[int, dict]:
        run_training(_config(tmp_path / name, "training.steps=2", "training.micro_batch_size=4", *extra))
        return _curves(tmp_path / name)

    mean = train("mean")  # one micro-batch of 4 rows: its masked mean is the per-token mean of the step
    tokens = train("tokens", "training.loss_normalization=global_tokens")
    split = train("split", "training.loss_normalization=global_tokens", "training.micro_batch_size=2",
                  "training.global_batch_size=4")  # the same 4 rows in 2 micro-batches of different token counts
    split_mean = train("split-mean", "training.micro_batch_size=2", "training.global_batch_size=4")
    for key in ("loss", "grad_norm"):
        assert _close(tokens, mean, key) <= 1e-6, key
        assert _close(split, tokens, key) <= 1e-5, key
        assert _close(split_mean, mean, key) > 1e-4, key  # a mean of micro-batch means weighs tokens unevenly


BALANCE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace
    import numpy as np
    import torch.distributed as dist
    from loongforge.data.sampler import TrainBatchIterator
    from loongforge.plugins import PluginHost
    from loongforge_balance.dp_balance.optimization import DPBalanceOptimization
    from loongforge_vlm.data.balanced import BalancedBatches

    sys.path.insert(0, sys.argv[2])
    from test_dp_balance_vlm import _rows

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = _rows()

    def run(fits):
        host = PluginHost(autoload=False)
        optimization = DPBalanceOptimization({"cost": {"a": 1e-3, "b": 1.0, "c": 10.0}})
        host.register(optimization, "optimization:dp-balance")
        balanced = BalancedBatches(rows, 2, 0, balance=lambda s: host.balance_samples(s, None), num_microbatches=2,
                                   dp_rank=rank, dp_size=size)
        if fits is not None:
            balanced.dp_fits = fits
        trainer = SimpleNamespace(data=balanced, step_metrics={})
        optimization.loongforge_on_train_start(trainer=trainer)  # takes the cap and dp_fits from the data
        plain = TrainBatchIterator(rows, 2, 0, dp_rank=rank, dp_size=size)
        steps = []
        for _ in range(4):
            trainer.step_metrics = {}
            for _ in range(2):
                next(balanced)
            held = []
            for _ in range(2):
                first = plain.consumed_samples + rank * 2
                held += [int(r) for r in plain.sample_indices(np.arange(first, first + 2))]
                next(plain)
            steps.append({"balanced": balanced.step_indices, "plain": [int(i) for r in held for i in rows.rows[r]],
                          "metrics": trainer.step_metrics, "cap": optimization.token_cap})
        return steps

    steps = {"fits": run(None), "never": run(lambda lengths: False)}
    everyone = [None] * size
    dist.all_gather_object(everyone, steps)
    if rank == 0:
        with open(f"{sys.argv[1]}/steps.json", "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.distributed
def test_two_ranks_train_the_same_samples_per_step_balanced_or_not(tmp_path):
    script = tmp_path / "balance.py"
    script.write_text(BALANCE_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(tmp_path), str(Path(__file__).parent)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = json.loads((tmp_path / "steps.json").read_text())
    moved = 0
    for step in range(4):
        fits = [r["fits"][step] for r in ranks]
        assert sorted(i for r in fits for i in r["balanced"]) == sorted(i for r in fits for i in r["plain"])
        moved += any(r["balanced"] != r["plain"] for r in fits)
        metrics = fits[0]["metrics"]
        assert fits[1]["metrics"] == metrics and fits[0]["cap"] == 2 * 2 * 96  # one plan on every rank
        assert metrics["dp_balance/max_over_mean"] <= metrics["dp_balance/max_over_mean_before"]
        assert metrics["dp_balance/unfit_steps"] == 0
        # a plan some rank cannot hold: every rank keeps the sampler's samples, and the step is counted
        never = [r["never"][step] for r in ranks]
        assert all(r["balanced"] == r["plain"] for r in never)
        assert never[0]["metrics"]["dp_balance/max_over_mean"] == never[0]["metrics"]["dp_balance/max_over_mean_before"]
    assert moved >= 2
    assert [r["metrics"]["dp_balance/unfit_steps"] for r in ranks[0]["never"]] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.distributed
def test_balanced_cli_run_matches_the_plain_run(tmp_path):
    def train(out: Path, *extra: str) -> dict[int, dict]:
        cmd = [sys.executable, "-m", "loongforge.cli", "train", str(CONFIG), f"run.output_dir={out}", *QUIET,
               "training.steps=3", "training.micro_batch_size=2", "training.global_batch_size=8",
               "training.loss_normalization=global_tokens", "--nproc", "2", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return _curves(out)

    plain = train(tmp_path / "plain")
    balanced = train(tmp_path / "balanced", f"optimizations.dp-balance.cost={COST}")
    assert _close(balanced, plain, "loss") <= 1e-5 and _close(balanced, plain, "grad_norm") <= 1e-5
    assert all(m["dp_balance/unfit_steps"] == 0 for m in balanced.values())
    assert all(m["dp_balance/max_over_mean"] < m["dp_balance/max_over_mean_before"] for m in balanced.values())
    assert "dp_balance/max_over_mean" not in plain[1]
