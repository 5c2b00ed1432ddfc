"""Advantages and the policy loss against values computed by hand."""

import math

import pytest
import torch

from learner.losses import PolicyLossInputs, aggregate, group_advantages, policy_loss_terms


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
    terms = policy_loss_terms(PolicyLossInputs(logprobs, old, rollout, torch.tensor([2.0])), 0.2, 2.0)
    # token 1: ratio 1.25 clipped to 1.2 (A > 0); weight 0.4/0.1 = 4 truncated to 2
    # token 2: ratio 1; weight 0.9/0.8 = 1.125
    assert terms.tis_weight[0].tolist() == pytest.approx([2.0, 1.125])
    assert terms.per_token[0].tolist() == pytest.approx([-2.0 * 1.2 * 2.0, -1.125 * 1.0 * 2.0])
    assert terms.clipped.tolist() == [[1.0, 0.0]]


def test_negative_advantage_clips_on_the_low_side():
    logprobs = torch.tensor([[math.log(0.3)]])
    old = torch.tensor([[math.log(0.5)]])
    terms = policy_loss_terms(PolicyLossInputs(logprobs, old, old, torch.tensor([-1.0])), 0.2, 2.0)
    # ratio 0.6: min(0.6 * -1, 0.8 * -1) = -0.8 -> loss 0.8
    assert terms.per_token.item() == pytest.approx(0.8)
    assert terms.clipped.item() == 1.0


def test_gradient_raises_logprob_of_positive_advantage():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inputs = PolicyLossInputs(logprobs, logprobs.detach(), logprobs.detach(), torch.tensor([1.0]))
    policy_loss_terms(inputs, 0.2, 2.0).per_token.sum().backward()
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
