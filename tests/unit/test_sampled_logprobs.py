"""The worker reads each sampled token's logprob from vLLM's flat logprobs as they are, and
from the per-position dicts of any other layout, with the same result."""

from __future__ import annotations

from vllm.logprobs import FlatLogprobs, Logprob

from rollout_server.worker import sampled_logprobs


def _positions(token_ids: list[int], values: list[float], extra: bool) -> list[dict[int, Logprob]]:
    """One dict a position: the sampled token, and with `extra` a runner-up ahead of it."""
    return [({token + 1: Logprob(-0.1, 1)} if extra else {}) | {token: Logprob(value, 2 if extra else 1)}
            for token, value in zip(token_ids, values)]


def test_flat_and_nested_logprobs_give_the_sampled_tokens_logprobs():
    token_ids, values = [5, 9, 5, 3], [-0.5, -1.25, -0.75, -2.0]
    flat = FlatLogprobs()
    flat.extend(_positions(token_ids, values, extra=False))
    assert sampled_logprobs(flat, token_ids) == values
    assert sampled_logprobs(_positions(token_ids, values, extra=False), token_ids) == values
    # more than the sampled token a position (logprobs > 0): looked up by token, flat or not
    crowded = FlatLogprobs()
    crowded.extend(_positions(token_ids, values, extra=True))
    assert sampled_logprobs(crowded, token_ids) == values
    assert sampled_logprobs(_positions(token_ids, values, extra=True), token_ids) == values
    assert sampled_logprobs(FlatLogprobs(), []) == []
