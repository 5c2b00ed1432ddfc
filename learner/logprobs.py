"""Per-token logprobs (and entropy) of completions under the learner's policy at temperature T."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # [batch, max_completion_len]
    entropy: torch.Tensor  # [batch, max_completion_len], detached
    mask: torch.Tensor  # [batch, max_completion_len], 1.0 on real completion tokens


def completion_logprobs(
    model, pairs: list[tuple[list[int], list[int]]], temperature: float, pad_id: int
) -> TokenScores:
    """log softmax(logits / T) of each completion token given its prompt and earlier tokens.

    Rows are right-padded; the logits at position p predict token p + 1.
    """
    lengths = [len(prompt) + len(completion) for prompt, completion in pairs]
    width, longest = max(lengths), max(len(completion) for _, completion in pairs)
    device = next(model.parameters()).device
    input_ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(pairs), width), dtype=torch.long)
    positions = torch.zeros((len(pairs), longest), dtype=torch.long)
    targets = torch.full((len(pairs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), longest))
    for row, (prompt, completion) in enumerate(pairs):
        input_ids[row, : lengths[row]] = torch.tensor(prompt + completion)
        attention[row, : lengths[row]] = 1
        count = len(completion)
        positions[row, :count] = torch.arange(len(prompt) - 1, len(prompt) - 1 + count)
        targets[row, :count] = torch.tensor(completion)
        mask[row, :count] = 1.0
    logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
    gather_at = positions.to(device).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    step_logits = logits.gather(1, gather_at).float() / temperature
    log_probs = torch.log_softmax(step_logits, dim=-1)
    chosen = log_probs.gather(-1, targets.to(device).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    mask = mask.to(device)
    return TokenScores(logprobs=chosen * mask, entropy=entropy * mask, mask=mask)
