"""Per-token logprobs (and entropy) of completions under the learner's policy at temperature T.

Only completion positions reach the vocabulary projection, a chunk of tokens at a time: the
full-vocabulary fp32 logits of a micro-batch (16 x 266 tokens x 152k x 4 B = 2.6 GB on a 7B
model, plus as much again for their log-softmax) never exist at once, and prompt positions are
never projected. Under autograd each chunk's logits are recomputed in backward instead of kept.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGIT_CHUNK_TOKENS = 2048
"""Completion tokens projected onto the vocabulary at once: 2048 x 152k fp32 logits = 1.2 GB."""


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # [batch, max_completion_len]
    entropy: torch.Tensor  # [batch, max_completion_len], detached
    mask: torch.Tensor  # [batch, max_completion_len], 1.0 on real completion tokens


@dataclass
class _Rows:
    """A right-padded micro-batch and where its completion tokens sit."""

    input_ids: torch.Tensor  # [batch, width]
    attention: torch.Tensor  # [batch, width]
    rows: torch.Tensor  # [tokens]: the row of each completion token
    predictors: torch.Tensor  # [tokens]: the position whose output predicts it (one before it)
    columns: torch.Tensor  # [tokens]: its index within the completion
    targets: torch.Tensor  # [tokens]: the token itself
    longest: int


def _rows(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> _Rows:
    lengths = [len(prompt) + len(completion) for prompt, completion in pairs]
    input_ids = torch.full((len(pairs), max(lengths)), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    rows, predictors, columns, targets = [], [], [], []
    for row, (prompt, completion) in enumerate(pairs):
        input_ids[row, : lengths[row]] = torch.tensor(prompt + completion)
        attention[row, : lengths[row]] = 1
        count = len(completion)
        rows += [row] * count
        predictors += range(len(prompt) - 1, len(prompt) - 1 + count)
        columns += range(count)
        targets += completion
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return _Rows(input_ids, attention, as_long(rows), as_long(predictors), as_long(columns), as_long(targets),
                 max(len(completion) for _, completion in pairs))


def _chunk_scores(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[target] and the entropy, for a chunk of token positions."""
    logits = F.linear(hidden, weight, bias).float() / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    with torch.no_grad():
        entropy = normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return chosen, entropy


def lora_in_compute_dtype(head_weight: torch.Tensor):
    """Autocast to the base's 16-bit compute dtype (none on an fp32 base): peft keeps the LoRA
    weights in fp32 (the optimizer's master copy) and would compute every LoRA product in fp32,
    casting each layer's input up and the result back (the bf16 7B learner profile in
    BENCHMARKS.md). vLLM computes LoRA in the engine dtype too. Gradient checkpointing
    recomputes under the same autocast state."""
    dtype = head_weight.dtype
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(head_weight.device.type, dtype=dtype)


def keep_lora_inputs_in_base_dtype(model) -> None:
    """On a 16-bit base, LoRA layers take their input as it comes (peft would cast it to the
    fp32 LoRA weights' dtype); `completion_logprobs` runs them under autocast instead."""
    from peft.tuners.lora import LoraLayer

    if model.get_output_embeddings().weight.dtype == torch.float32:
        return
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False


def completion_logprobs(
    model, pairs: list[tuple[list[int], list[int]]], temperature: float, pad_id: int
) -> TokenScores:
    """log softmax(logits / T) of each completion token given its prompt and earlier tokens.

    `model` is a causal LM (or a peft model around one); its decoder runs on the right-padded
    rows, then the completion positions' hidden states are projected chunk by chunk.
    """
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal.get_output_embeddings()
    device = head.weight.device
    batch = _rows(pairs, pad_id)
    with lora_in_compute_dtype(head.weight):
        hidden = causal.get_decoder()(input_ids=batch.input_ids.to(device),
                                      attention_mask=batch.attention.to(device)).last_hidden_state
    picked = hidden[batch.rows.to(device), batch.predictors.to(device)]  # [tokens, hidden]
    targets = batch.targets.to(device)
    chosen, entropy = [], []
    for first in range(0, picked.shape[0], LOGIT_CHUNK_TOKENS):
        args = (picked[first : first + LOGIT_CHUNK_TOKENS], head.weight, head.bias,
                targets[first : first + LOGIT_CHUNK_TOKENS], temperature)
        if torch.is_grad_enabled() and picked.requires_grad:
            scores = checkpoint(_chunk_scores, *args, use_reentrant=False)
        else:
            scores = _chunk_scores(*args)
        chosen.append(scores[0])
        entropy.append(scores[1])
    shape = (len(pairs), batch.longest)
    where = (batch.rows.to(device), batch.columns.to(device))
    logprobs = torch.zeros(shape, device=device).index_put(where, torch.cat(chosen))
    entropies = torch.zeros(shape, device=device).index_put(where, torch.cat(entropy))
    mask = torch.zeros(shape, device=device).index_put(where, torch.ones_like(targets, dtype=torch.float32))
    return TokenScores(logprobs=logprobs, entropy=entropies, mask=mask)
