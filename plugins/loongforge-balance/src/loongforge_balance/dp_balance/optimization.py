"""``optimizations: {dp-balance: {...}}``: balance variable-length samples across data-parallel ranks every step.

Options:

* ``warmup_steps`` (default 16, at least 8): steps measured, unbalanced, before the cost model is fitted from
  their step times (the first step of a process is not measured: it includes one-off work);
* ``cost`` (``{a, b, c}``, optionally ``d``, ``e`` for a vision encoder's patches and patch pairs): pin the cost
  model instead of fitting it (no warm-up); see :mod:`loongforge_balance.dp_balance.cost`;
* ``token_cap``: the most tokens a rank may receive (activation memory); by default the data path's own cap;
* ``length_key`` (default ``tokens``): the sample field whose first dimension is the sample's length.

The run needs ``training.loss_normalization: global_tokens`` (moving samples changes each rank's token count; a
per-micro-batch mean would then change the gradient), checked before anything is built. The data path must call the
``loongforge_balance_samples`` hook and mark its batch iterator ``dp_balanced = True`` (see
``docs/plugin-authors.md``): loongforge-vlm's packed image-text rows do; a run whose data does not (core's
fixed-length pretraining and SFT rows, where every rank already does the same compute) is refused at train start
rather than run unbalanced. A data path with fixed rows per rank gives its capacity as ``dp_token_cap`` (the plan
never exceeds it) and ``dp_fits(lengths)`` (whether a rank's rows can hold samples of these lengths); a step whose
better plan some rank cannot hold trains the sampler's placement and is counted. Metrics per balanced step, recorded
with the step (``trainer.step_metrics``): ``dp_balance/max_over_mean`` (predicted max / mean rank load of what is
trained), ``dp_balance/max_over_mean_before`` (the sampler's placement) and ``dp_balance/unfit_steps`` (steps so far
kept in the sampler's placement because a rank's rows could not hold its planned samples). The fitted coefficients
are saved in checkpoints, so a resumed run does not warm up again.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from loongforge import hookimpl
from loongforge.errors import ConfigError
from loongforge.optimizations import Optimization

from loongforge_balance.dp_balance.balance import rebalance
from loongforge_balance.dp_balance.cost import CostModel
from loongforge_balance.dp_balance.fit import fit_from_steps
from loongforge_balance.dp_balance.solver import CapacityError

NAME = "dp-balance"
#: Fewer measured steps than about twice the 4 unknowns let a wrong guess of the slowest ranks fit as well.
MIN_WARMUP = 8


@dataclass(frozen=True)
class DPBalanceOptions:
    """``optimizations.dp-balance``: see the module docstring for what each option means."""

    warmup_steps: int = 16
    #: ``{a, b, c}`` (and ``d``, ``e``: encoder terms): pin the cost model instead of fitting it.
    cost: CostModel | None = None
    token_cap: int | None = None
    length_key: str = "tokens"

    def __post_init__(self) -> None:
        if self.warmup_steps < MIN_WARMUP:
            raise ConfigError(f"warmup_steps must be an integer >= {MIN_WARMUP} (3 coefficients and a step overhead "
                              f"are fitted from the slowest rank's times), got {self.warmup_steps}")
        if self.token_cap is not None and self.token_cap < 1:
            raise ConfigError(f"token_cap must be a positive integer, got {self.token_cap}")
        if not self.length_key:
            raise ConfigError("length_key must be a field name, got ''")


class DPBalanceOptimization(Optimization):
    """The plugin object registered for a run: answers ``loongforge_balance_samples``, fits during warm-up."""

    name = NAME
    options_type = DPBalanceOptions

    def __init__(self, options: Mapping[str, Any] | None = None, *, source: str = "config") -> None:
        super().__init__(options, source=source)
        opts: DPBalanceOptions = self.options
        self.warmup_steps, self.cost, self.token_cap, self.length_key = (opts.warmup_steps, opts.cost,
                                                                          opts.token_cap, opts.length_key)
        #: (every rank's sample lengths, every rank's samples' encoder work, step time) of the measured warm-up steps.
        self.observations: list[tuple[list[np.ndarray], list[np.ndarray], float]] = []
        #: Predicted ``max / mean`` rank load of the last balanced call, before and after.
        self.last_imbalance: tuple[float, float] | None = None
        self._group: Any = None
        self._step_lengths: list[list[int]] | None = None
        self._step_encoder: list[list[list[int]]] | None = None
        self._first_step_done = False
        #: Balanced steps kept in the sampler's placement because some rank's rows could not hold its new samples.
        self.unfit_steps = 0
        self._fits: Any = None
        self._trainer: Any = None

    @hookimpl
    def loongforge_configure(self, config: Any) -> None:
        normalization = config.training.loss_normalization
        if normalization != "global_tokens":
            raise ConfigError(
                f"{config.source}: optimizations.{NAME} needs training.loss_normalization: global_tokens (got "
                f"'{normalization}'): balanced ranks hold different token counts, and a per-micro-batch mean would "
                "weigh their tokens differently"
            )

    @hookimpl
    def loongforge_on_train_start(self, trainer: Any) -> None:
        if not getattr(trainer.data, "dp_balanced", False):
            raise ConfigError(
                f"optimizations.{NAME}: the run's data ({type(trainer.data).__name__}, data.dataset "
                f"'{trainer.config.data.dataset}') does not call loongforge_balance_samples: its micro-batches are "
                "fixed-length rows on which every data-parallel rank does the same compute; dp-balance needs a "
                "variable-length data path (e.g. loongforge-vlm's)"
            )
        data_cap = getattr(trainer.data, "dp_token_cap", None)
        if data_cap is not None:  # the rows a rank fills bound what it may receive
            self.token_cap = data_cap if self.token_cap is None else min(self.token_cap, data_cap)
        self._fits = getattr(trainer.data, "dp_fits", None)
        self._trainer = trainer

    @hookimpl
    def loongforge_balance_samples(self, samples: list, dp_group: Any) -> list:
        self._group = dp_group
        if self.cost is None:  # warm-up: train the sampler's placement and remember it for the fit
            from loongforge_balance.dp_balance.exchange import gather_layout

            layout = gather_layout(samples, dp_group, self.length_key)
            self._record(layout.rank_lengths(), layout.rank_encoder())
            return samples
        try:
            result = rebalance(samples, self.cost, dp_group, token_cap=self.token_cap, length_key=self.length_key,
                               fits=self._fits)
        except CapacityError as exc:  # same on every rank: the plan is computed from the same gathered sizes
            warnings.warn(f"{NAME}: kept the sampler's placement for this batch: {exc}", stacklevel=2)
            return samples
        self.unfit_steps += result.unfit
        self.last_imbalance = (result.before.imbalance, result.after.imbalance)
        if self._trainer is not None:
            self._trainer.step_metrics.update({
                "dp_balance/max_over_mean": result.after.imbalance,
                "dp_balance/max_over_mean_before": result.before.imbalance,
                "dp_balance/unfit_steps": self.unfit_steps,
            })
        return result.samples

    def _record(self, rank_lengths: list[np.ndarray], rank_encoder: list[np.ndarray | None]) -> None:
        if self._step_lengths is None or self._step_encoder is None:
            self._step_lengths, self._step_encoder = [[] for _ in rank_lengths], [[] for _ in rank_lengths]
        for held, work, lengths, encoder in zip(self._step_lengths, self._step_encoder, rank_lengths, rank_encoder,
                                                strict=True):
            held.extend(lengths.tolist())
            work.extend(np.zeros((len(lengths), 2), dtype=np.int64).tolist() if encoder is None else encoder.tolist())

    @hookimpl
    def loongforge_on_step_end(self, trainer: Any, step: int, metrics: dict) -> None:
        lengths, encoder, self._step_lengths, self._step_encoder = self._step_lengths, self._step_encoder, None, None
        if self.cost is not None or lengths is None or encoder is None:
            return
        if not self._first_step_done:
            self._first_step_done = True
            return
        # Ranks time their step slightly differently; the slowest rank's time is the step's, the same everywhere.
        seconds = torch.tensor([float(metrics["step_time"])], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self._group)
        self.observations.append(([np.asarray(x) for x in lengths],
                                  [np.asarray(w, dtype=np.int64).reshape(-1, 2) for w in encoder],
                                  float(seconds.item())))
        if len(self.observations) >= self.warmup_steps:
            self.cost = self._fit()

    def _fit(self) -> CostModel:
        """Fit on the group's first rank and broadcast, so that every rank plans with bit-identical coefficients."""
        model, _ = fit_from_steps([o[0] for o in self.observations], [o[2] for o in self.observations],
                                  [o[1] for o in self.observations])
        coefficients = torch.tensor(list(model.as_dict().values()), dtype=torch.float64)
        first = 0 if self._group is None else dist.get_global_rank(self._group, 0)
        dist.broadcast(coefficients, src=first, group=self._group)
        return CostModel(*coefficients.tolist())

    @hookimpl
    def loongforge_on_checkpoint_save(self, trainer: Any, path: str, extra_state: dict) -> None:
        if self.cost is not None:
            extra_state[NAME] = {"cost": self.cost.as_dict()}

    @hookimpl
    def loongforge_on_checkpoint_load(self, trainer: Any, path: str, extra_state: dict) -> None:
        saved = extra_state.get(NAME)
        if saved is not None and self.cost is None:
            self.cost = CostModel(**saved["cost"])
