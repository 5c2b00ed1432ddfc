"""Advantages and the policy-gradient loss.

GRPO: rewards are normalised within each prompt's group of samples. The loss is PPO's clipped
surrogate, with the ratio taken against the learner's own pre-update logprobs, and every token
weighted by a truncated importance weight min(pi_old / pi_rollout, cap): the rollout engine
(quantized, noised by AQN, possibly an adapter version behind) is not exactly the learner's
policy, and this corrects for it without letting rare tokens blow up the gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggregation = Literal["seq_mean_token_mean", "token_mean"]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, samples] -> (r - group mean) / (group population std + eps)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def policy_loss_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    tis_cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss [batch, tokens], importance weights and a clipped-token indicator."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = torch.exp(old_logprobs - rollout_logprobs).clamp(max=tis_cap).detach()
    advantage = advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    per_token = -weight * torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    return per_token, weight, was_clipped


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
