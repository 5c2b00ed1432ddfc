"""Advantages, reward shaping and the policy-gradient loss (GRPO and DAPO).

GRPO: rewards are normalised within each prompt's group of samples. The loss is PPO's clipped
surrogate (DAPO: with a wider upper clip, "clip-higher"), with the ratio taken against the
learner's logprobs before the rollout batch's first optimizer step (`learner.mini_batches` > 1
makes it differ from 1), and every token weighted by a truncated importance weight
min(pi_old / pi_rollout, cap): the rollout engine (quantized, noised by AQN, possibly an
adapter version behind) is not exactly the learner's policy, and this corrects for it without
letting rare tokens blow up the gradient. An optional KL penalty pulls towards the reference
policy (k3 estimator, as in the GRPO paper).
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


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [groups, samples] -> [groups] bool: groups whose rewards are not all equal
    (DAPO's dynamic sampling keeps these; an all-equal group has zero advantages, no gradient)."""
    return (rewards != rewards[:, :1]).any(dim=1)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer tokens, then falling
    linearly to -factor at max_new_tokens."""
    if buffer <= 0 or length <= max_new_tokens - buffer:
        return 0.0
    return -factor * min(length - (max_new_tokens - buffer), buffer) / buffer


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
    ref_logprobs: torch.Tensor | None = None
    """The reference policy's logprobs (the base, adapter off), for the KL penalty."""


@dataclass(frozen=True)
class PolicyLossTerms:
    per_token: torch.Tensor
    """The loss of every token, before masking and aggregation."""
    tis_weight: torch.Tensor
    """min(pi_old / pi_rollout, cap), detached."""
    clipped: torch.Tensor
    """1.0 where the clipped surrogate was the smaller one (the clip removed the gradient)."""
    importance_ratio: torch.Tensor
    """pi_old / pi_rollout before truncation, detached."""
    ref_kl: torch.Tensor | None
    """k3 KL estimate to the reference per token (with grad), when a reference was given."""


def policy_loss_terms(inputs: PolicyLossInputs, clip_low: float, clip_high: float, tis_cap: float,
                      kl_coef: float = 0.0) -> PolicyLossTerms:
    """Per-token clipped surrogate in [1 - clip_low, 1 + clip_high], weighted by the truncated
    importance weight, plus kl_coef * k3(reference || learner) where a reference is given."""
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    importance = torch.exp(inputs.old_logprobs - inputs.rollout_logprobs).detach()
    weight = importance.clamp(max=tis_cap)
    advantage = inputs.advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantage
    per_token = -weight * torch.minimum(unclipped, clipped)
    ref_kl = None
    if inputs.ref_logprobs is not None:
        log_ref_ratio = inputs.ref_logprobs - inputs.logprobs
        ref_kl = log_ref_ratio.exp() - log_ref_ratio - 1
        per_token = per_token + kl_coef * ref_kl
    return PolicyLossTerms(per_token, weight, (clipped < unclipped).float(), importance, ref_kl)


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
