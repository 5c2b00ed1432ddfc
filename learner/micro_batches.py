"""How a learner step cuts its samples into micro-batches.

Rows of a micro-batch are padded to its longest sequence. RL completions differ widely in
length (reasoning traces are long-tailed), so micro-batches of consecutive samples waste much
of their compute on padding. Sorting by length first makes neighbours alike; a token budget
(rows x longest row) lets many short sequences share a micro-batch where few long ones fit.
The loss is normalised over the whole mini-batch, so the order changes no gradient beyond
floating-point rounding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchPlan:
    batches: list[list[int]]
    """Sample indices of each micro-batch, longest sequences first."""
    real_tokens: int
    padded_tokens: int

    @property
    def padding_frac(self) -> float:
        """Share of the computed token slots that are padding."""
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


def plan_micro_batches(lengths: list[int], max_rows: int, max_tokens: int | None = None) -> MicroBatchPlan:
    """Micro-batches of at most `max_rows` sequences and, when given, at most `max_tokens`
    padded token slots (a single longer sequence still gets a micro-batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        current = batches[-1] if batches else None
        # sorted longest first: the batch's first row sets its padded width
        fits = current is not None and len(current) < max_rows and (
            max_tokens is None or (len(current) + 1) * lengths[current[0]] <= max_tokens)
        if fits:
            current.append(index)
        else:
            batches.append([index])
    padded = sum(len(batch) * lengths[batch[0]] for batch in batches)
    return MicroBatchPlan(batches, sum(lengths), padded)


def arrival_order_plan(lengths: list[int], max_rows: int) -> MicroBatchPlan:
    """Consecutive samples, `max_rows` at a time (what the learner did before sorting): the
    padding it would cost, for the metrics."""
    batches = [list(range(first, min(first + max_rows, len(lengths)))) for first in range(0, len(lengths), max_rows)]
    padded = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    return MicroBatchPlan(batches, sum(lengths), padded)
