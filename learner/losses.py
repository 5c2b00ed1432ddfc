"""Advantages and the policy-gradient loss.

GRPO: rewards are normalised within each prompt's group of samples. The loss is PPO's clipped
surrogate, with the ratio taken against the learner's logprobs before the rollout batch's first
optimizer step (`learner.mini_batches` > 1 makes it differ from 1), and every token
weighted by a truncated importance weight min(pi_old / pi_rollout, cap): the rollout engine
(quantized, noised by AQN, possibly an adapter version behind) is not exactly the learner's
policy, and this corrects for it without letting rare tokens blow up the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAggregation = Literal["seq_mean_token_mean", "token_mean"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, samples] -> (r - group mean) / (group population std + eps)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch's tensors, [batch, tokens] unless noted."""

    logprobs: torch.Tensor
    """The learner's logprobs of the sampled tokens now (with grad)."""
    old_logprobs: torch.Tensor
    """The learner's logprobs before the batch's first optimizer step (no grad)."""
    rollout_logprobs: torch.Tensor
    """What the rollout engine sampled them with."""
    advantages: torch.Tensor
    """[batch]: one advantage per sequence."""


@dataclass(frozen=True)
class PolicyLossTerms:
    per_token: torch.Tensor
    """The loss of every token, before masking and aggregation."""
    tis_weight: torch.Tensor
    """min(pi_old / pi_rollout, cap), detached."""
    clipped: torch.Tensor
    """1.0 where the clipped surrogate was the smaller one (the clip removed the gradient)."""


def policy_loss_terms(inputs: PolicyLossInputs, clip_eps: float, tis_cap: float) -> PolicyLossTerms:
    """Per-token clipped surrogate, weighted by the truncated importance weight."""
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    weight = torch.exp(inputs.old_logprobs - inputs.rollout_logprobs).clamp(max=tis_cap).detach()
    advantage = inputs.advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    per_token = -weight * torch.minimum(unclipped, clipped)
    return PolicyLossTerms(per_token, weight, (clipped < unclipped).float())


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, how: LossAggregation, total_seqs: int, total_tokens: int
) -> torch.Tensor:
    """Reduce a micro-batch so that summing over micro-batches gives the full-batch mean.

    seq_mean_token_mean (GRPO): mean over each sequence's tokens, then over sequences.
    token_mean (DAPO): one mean over all tokens of the batch.
    """
    if how == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / total_seqs
    return (per_token * mask).sum() / max(total_tokens, 1)
