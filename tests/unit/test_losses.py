"""Advantages and the policy loss against values computed by hand."""

import math

import pytest
import torch

from learner.losses import (
    PolicyLossInputs,
    aggregate,
    group_advantages,
    informative_groups,
    overlong_penalty,
    policy_loss_terms,
)
from shared.config import LearnerConfig


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    advantages = group_advantages(rewards)
    # group 1: mean 0.5, population std 0.5 -> +-1
    assert advantages[0].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    # group 2: no spread, no signal
    assert advantages[1].tolist() == [0, 0, 0, 0]
    # group 3: mean 0.75, std sqrt(3*0.75^2 + 2.25^2)/2 = 1.299...
    std = math.sqrt((3 * 0.75**2 + 2.25**2) / 4)
    assert advantages[2].tolist() == pytest.approx([-0.75 / std] * 3 + [2.25 / std], abs=1e-5)


def test_policy_loss_terms_by_hand():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.9)]])
    old = torch.tensor([[math.log(0.4), math.log(0.9)]])
    rollout = torch.tensor([[math.log(0.1), math.log(0.8)]])
    terms = policy_loss_terms(PolicyLossInputs(logprobs, old, rollout, torch.tensor([2.0])), 0.2, 0.2, 2.0)
    # token 1: ratio 1.25 clipped to 1.2 (A > 0); weight 0.4/0.1 = 4 truncated to 2
    # token 2: ratio 1; weight 0.9/0.8 = 1.125
    assert terms.tis_weight[0].tolist() == pytest.approx([2.0, 1.125])
    assert terms.per_token[0].tolist() == pytest.approx([-2.0 * 1.2 * 2.0, -1.125 * 1.0 * 2.0])
    assert terms.clipped.tolist() == [[1.0, 0.0]]


def test_negative_advantage_clips_on_the_low_side():
    logprobs = torch.tensor([[math.log(0.3)]])
    old = torch.tensor([[math.log(0.5)]])
    terms = policy_loss_terms(PolicyLossInputs(logprobs, old, old, torch.tensor([-1.0])), 0.2, 0.2, 2.0)
    # ratio 0.6: min(0.6 * -1, 0.8 * -1) = -0.8 -> loss 0.8
    assert terms.per_token.item() == pytest.approx(0.8)
    assert terms.clipped.item() == 1.0


def test_gradient_raises_logprob_of_positive_advantage():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = PolicyLossInputs(logprobs, logprobs.detach(), logprobs.detach(), torch.tensor([1.0]))
    policy_loss_terms(inputs, 0.2, 0.2, 2.0).per_token.sum().backward()
    assert (logprobs.grad < 0).all()  # descending the loss increases these logprobs


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # sequence means 2 and 4, over 2 sequences -> 3; token mean (1 + 3 + 4) / 3
    assert aggregate(per_token, mask, "seq_mean_token_mean", 2, 3).item() == pytest.approx(3.0)
    assert aggregate(per_token, mask, "token_mean", 2, 3).item() == pytest.approx(8 / 3)
    # micro-batches sum to the full-batch value
    halves = [aggregate(per_token[i : i + 1], mask[i : i + 1], "token_mean", 2, 3) for i in range(2)]
    assert sum(h.item() for h in halves) == pytest.approx(8 / 3)


def test_clip_higher_by_hand():
    # ratio 1.25 with A > 0: GRPO's symmetric 0.2 clips it to 1.2, DAPO's upper 0.28 leaves it
    logprobs, old = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.4)]])
    inputs = PolicyLossInputs(logprobs, old, old, torch.tensor([1.0]))
    assert policy_loss_terms(inputs, 0.2, 0.2, 2.0).per_token.item() == pytest.approx(-1.2)
    dapo = policy_loss_terms(inputs, 0.2, 0.28, 2.0)
    assert dapo.per_token.item() == pytest.approx(-1.25)
    assert dapo.clipped.item() == 0.0
    # ratio 1.5 is clipped by both, at their own bounds
    far = PolicyLossInputs(torch.tensor([[math.log(0.6)]]), old, old, torch.tensor([1.0]))
    assert policy_loss_terms(far, 0.2, 0.28, 2.0).per_token.item() == pytest.approx(-1.28)
    # the lower side stays at clip_eps: ratio 0.5 with A < 0 -> min(-0.5, -0.8) = -0.8 -> loss 0.8
    low = PolicyLossInputs(torch.tensor([[math.log(0.2)]]), old, old, torch.tensor([-1.0]))
    assert policy_loss_terms(low, 0.2, 0.28, 2.0).per_token.item() == pytest.approx(0.8)


def test_kl_penalty_by_hand():
    # k3(ref || learner) = exp(ref - logp) - (ref - logp) - 1; pi = 0.5, pi_ref = 0.25
    logprobs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    inputs = PolicyLossInputs(logprobs, logprobs.detach(), logprobs.detach(), torch.tensor([0.0]), ref)
    terms = policy_loss_terms(inputs, 0.2, 0.2, 2.0, kl_coef=0.1)
    k3 = 0.5 - math.log(0.5) - 1
    assert terms.ref_kl.item() == pytest.approx(k3)
    assert terms.per_token.item() == pytest.approx(0.1 * k3)  # advantage 0: only the penalty
    terms.per_token.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp)] = -exp(ref - logp) + 1 = 0.5, times 0.1
    assert logprobs.grad.item() == pytest.approx(0.05)
    # the same policy as the reference: no penalty
    same = PolicyLossInputs(ref, ref, ref, torch.tensor([0.0]), ref)
    assert policy_loss_terms(same, 0.2, 0.2, 2.0, kl_coef=0.1).per_token.item() == pytest.approx(0.0)


def test_importance_ratio_is_reported_before_truncation():
    old, rollout = torch.tensor([[math.log(0.4), math.log(0.2)]]), torch.tensor([[math.log(0.1), math.log(0.2)]])
    terms = policy_loss_terms(PolicyLossInputs(old, old, rollout, torch.tensor([1.0])), 0.2, 0.2, 2.0)
    assert terms.importance_ratio[0].tolist() == pytest.approx([4.0, 1.0])
    assert terms.tis_weight[0].tolist() == pytest.approx([2.0, 1.0])


def test_informative_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.2]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]


def test_overlong_penalty_by_hand():
    # max 8 tokens, buffer 4: no penalty up to 4 tokens, then -1/4 per token down to -1 at 8
    assert [overlong_penalty(n, 8, 4) for n in (3, 4, 5, 6, 8)] == pytest.approx([0, 0, -0.25, -0.5, -1.0])
    assert overlong_penalty(8, 8, 4, factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(8, 8, 0) == 0.0


def test_algorithm_defaults():
    grpo, dapo = LearnerConfig(), LearnerConfig(algorithm="dapo")
    assert (grpo.upper_clip(), grpo.aggregation(), grpo.uses_dynamic_sampling(), grpo.overlong_tokens(8)) == (
        0.2, "seq_mean_token_mean", False, 0)
    assert (dapo.upper_clip(), dapo.aggregation(), dapo.uses_dynamic_sampling(), dapo.overlong_tokens(8)) == (
        0.28, "token_mean", True, 2)
    explicit = LearnerConfig(algorithm="dapo", clip_eps_high=0.3, loss_agg="seq_mean_token_mean",
                             dynamic_sampling=False, overlong_buffer=0)
    assert (explicit.upper_clip(), explicit.aggregation(), explicit.uses_dynamic_sampling(),
            explicit.overlong_tokens(8)) == (0.3, "seq_mean_token_mean", False, 0)


def test_the_learning_rate_warms_up_then_follows_its_schedule():
    from learner.actor import lr_factor
    from shared.config import LearnerConfig

    constant = LearnerConfig(warmup_steps=4)
    assert [lr_factor(s, constant) for s in (0, 3, 4, 100)] == [0.2, 0.8, 1.0, 1.0]
    cosine = LearnerConfig(warmup_steps=4, lr_schedule="cosine", lr_min_ratio=0.1, decay_steps=14)
    assert lr_factor(4, cosine) == 1.0
    assert lr_factor(9, cosine) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_factor(14, cosine) == pytest.approx(0.1) and lr_factor(40, cosine) == pytest.approx(0.1)
