"""The megatron step engine for ``training.phase: dpo``: every step scores its pairs with the reference, then trains
the policy on them.

What differs from the language-model step (:class:`~loongforge.train.engines.megatron.MegatronEngine`) is small and
lives here: a micro-batch holds ``2 x micro_batch_size`` sequences (a pair's chosen and rejected rows travel together,
through every pipeline stage to the last, which scores the pair); before the policy's forward-backward, this rank's
micro-batches of the step go once through the reference in a forward-only pass of megatron's schedule (so the
reference is tensor-, pipeline- and data-parallel like the policy), and the last stage keeps each row's reference
log-prob on its micro-batch (:data:`~loongforge.train.preference.objective.REFERENCE_LOGPS`); the loss is the
objective's (:mod:`loongforge.train.preference.objective`). Evaluation scores the held-out pairs the same way and
reports ``loss`` and the ``dpo/*`` means (held-out preference accuracy is ``val_dpo/accuracy``).

``dpo.precompute_reference`` runs that pass once over every training and validation pair instead, at the first step
or evaluation (so after a resume, from the same reference: the same table), and looks the log-probs up by pair; the
frozen copy is then dropped. The data position, RNG streams and weights are what the language-model engine keeps, so
checkpoints and resume are unchanged: the reference is rebuilt from the starting weights (see
:mod:`loongforge.train.preference.reference`) and never saved.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from loongforge.data.preference_dataset import PAIR_INDEX
from loongforge.train.engines.megatron import MegatronEngine
from loongforge.train.preference.objective import REFERENCE_LOGPS, REPORT, PreferenceObjective
from loongforge.train.preference.reference import ReferenceModel

#: The splits whose pairs a precomputed reference covers.
_TRAIN, _VALID = "train", "valid"


class PreferenceEngine(MegatronEngine):
    """:class:`MegatronEngine` over preference pairs: ``objective`` is the loss, ``reference`` where the reference
    log-probs come from (``None``: no reference), ``precompute`` whether they are computed once before training."""

    phase: ClassVar[str] = "dpo"

    def __init__(self, *, objective: PreferenceObjective, reference: ReferenceModel | None, precompute: bool,
                 **engine: Any) -> None:
        super().__init__(**engine)
        self.objective = objective
        self.reference = reference
        self.tokens_per_step = 2 * self.tokens_per_step  # two sequences per pair
        #: ``{split: [pairs, 2] log-probs}`` once computed (``dpo.precompute_reference``); ``None``: every step.
        self._tables: dict[str, torch.Tensor] | None = {} if precompute else None

    @property
    def rows_per_micro_batch(self) -> int:
        return 2 * self.config.training.micro_batch_size

    # -- the step's feed, loss and numbers --------------------------------------------------------

    def _train_feed(self) -> Any:
        micro_batches = [next(self.data) for _ in range(self.num_microbatches)]
        self._attach_reference(micro_batches, _TRAIN)
        return self._feed(iter(micro_batches))

    def _validation_feed(self) -> Any:
        micro_batches = list(self._validation_micro_batches())
        self._attach_reference(micro_batches, _VALID)
        return self._feed(iter(micro_batches))

    def _loss_func(self, batch: dict[str, Any], *, token_sums: bool) -> Any:
        return partial(self.objective.loss, batch)

    def _step_numbers(self, reduced: list[dict]) -> tuple[float, dict[str, float]]:
        numbers = self._pair_means(reduced)
        return numbers.pop("loss"), numbers

    def _validation_numbers(self, reduced: list[dict]) -> dict[str, float]:
        return self._pair_means(reduced)

    def _pair_means(self, reduced: list[dict]) -> dict[str, float]:
        """The objective's means over every pair of the pass: its reports summed over micro-batches, data-parallel
        ranks and (from the last stage) the pipeline; known on every rank."""
        if self._last_stage:
            report = torch.stack([r[REPORT] for r in reduced]).sum(0)
        else:
            report = self.objective.empty_report()
        if self._dp_size > 1:
            dist.all_reduce(report, group=self._dp_group)
        if self._pp_size > 1:
            dist.all_reduce(report, group=self._pp_group)
        return self.objective.numbers(report)

    # -- the reference ------------------------------------------------------------------------------

    def _attach_reference(self, micro_batches: list[dict[str, Any]], split: str) -> None:
        """Put each row's reference log-prob on its micro-batch (on the last stage; nothing without a reference)."""
        if self.reference is None:
            return
        if self._tables is None:
            logps = self.reference_logps(micro_batches)
        else:
            table = self._table(split)
            logps = [torch.cat([table[batch[PAIR_INDEX], 0], table[batch[PAIR_INDEX], 1]]) for batch in micro_batches]
        for batch, rows in zip(micro_batches, logps, strict=False):  # the last stage only has them
            batch[REFERENCE_LOGPS] = rows

    def reference_logps(self, micro_batches: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The reference's log-prob of every row of ``micro_batches`` (one ``[2m]`` tensor per micro-batch on the
        last pipeline stage, none on the others): one forward-only pass of the schedule."""
        with self.reference.scoring(self.model) as chunks:
            reduced = self._forward_pass(self._reference_step, micro_batches, chunks)
        return [r[REFERENCE_LOGPS] for r in reduced]

    def _reference_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        return self._per_token_loss(batch, model), partial(self.objective.reference_report, batch["loss_mask"])

    def _memory_mib(self, trainer: Any) -> dict[str, float]:
        """The language-model engine's memory by component, and the frozen copy's weights (``reference``)."""
        memory = super()._memory_mib(trainer)
        if self.reference is not None and self.reference.chunks:
            memory["reference"] = round(sum(p.numel() * p.element_size() for chunk in self.reference.chunks
                                            for p in chunk.parameters()) / 2**20, 2)
        return memory

    def _table(self, split: str) -> torch.Tensor:
        """The precomputed log-probs of ``split``'s pairs; at the first call every split's are computed and the
        frozen copy is dropped."""
        if not self._tables:
            self._tables[_TRAIN] = self._precompute(self.data.dataset)
            if self._validation is not None:
                self._tables[_VALID] = self._precompute(self._validation.rows)
            if not self.reference.adapters_off:
                self.reference = ReferenceModel(self.reference.kind, [])
        return self._tables[split]

    def _precompute(self, rows: Any) -> torch.Tensor:
        """``[pairs, 2]``: the reference's chosen and rejected log-prob of every pair of ``rows``. Global batch ``k``'s
        micro-batch on data-parallel rank ``r`` holds pairs ``k x G + r x m ...`` (``G`` pairs per global batch, ``m``
        per micro-batch), wrapping around at the end; each pair is taken from the one place it first appears, and the
        ranks' tables are summed."""
        pairs, m = len(rows), self.config.training.micro_batch_size
        per_global = m * self._dp_size
        positions = [np.arange(start, start + m) for start in
                     range(self._dp_rank * m, -(-pairs // per_global) * per_global, per_global)]
        logps = self.reference_logps([rows.batch(p % pairs) for p in positions])
        table = torch.zeros(pairs, 2, dtype=torch.float64)
        for p, rows_logps in zip(positions, logps, strict=False):
            own = torch.from_numpy(p < pairs)
            index = torch.from_numpy(p)[own]
            table[index, 0] = rows_logps[:m][own]
            table[index, 1] = rows_logps[m:][own]
        if self._dp_size > 1:
            dist.all_reduce(table, group=self._dp_group)
        return table
