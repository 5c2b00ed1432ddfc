"""Micro-batch planning: sorted by length, within the row and token limits, every sample once;
and the padding it saves on a long-tailed length mix."""

from __future__ import annotations

import random

from benchmarks.step import draw_lengths
from learner.micro_batches import arrival_order_plan, plan_micro_batches


def test_every_sample_is_planned_once_within_the_limits():
    lengths = [random.Random(3).randrange(1, 300) for _ in range(97)]
    plan = plan_micro_batches(lengths, max_rows=8, max_tokens=1000)
    assert sorted(i for batch in plan.batches for i in batch) == list(range(97))
    for batch in plan.batches:
        assert len(batch) <= 8
        assert len(batch) == 1 or len(batch) * lengths[batch[0]] <= 1000
        assert lengths[batch[0]] == max(lengths[i] for i in batch)


def test_a_sequence_longer_than_the_token_budget_gets_a_micro_batch_of_its_own():
    plan = plan_micro_batches([50, 10, 10], max_rows=4, max_tokens=30)
    assert plan.batches == [[0], [1, 2]]


def test_sorting_cuts_the_padding_of_long_tailed_lengths():
    lengths = [10 + n for n in draw_lengths(512, 256, "lognormal", seed=0)]
    sorted_plan = plan_micro_batches(lengths, max_rows=16)
    assert arrival_order_plan(lengths, 16).padding_frac > 0.4
    assert sorted_plan.padding_frac < 0.05
    assert sorted_plan.real_tokens == sum(lengths)


def test_lognormal_lengths_have_a_mean_near_a_third_of_the_limit_and_a_tail():
    lengths = draw_lengths(20000, 300, "lognormal", seed=1)
    assert 85 <= sum(lengths) / len(lengths) <= 105  # clipping at the limit pulls the mean below 100
    assert min(lengths) >= 1 and max(lengths) == 300
    assert draw_lengths(3, 7, "fixed", seed=0) == [7, 7, 7]
