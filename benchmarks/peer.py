"""The rollout bench's peer: Hugging Face `generate` with the same base (NF4 by default) and the
same peft adapter, in the benchmark's own process."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.common import sync_device
from shared.adapter_payload import decode_adapter
from shared.types import AdapterUpdate


def hf_generate_throughput(folder: Path, is_random: bool, peer_format: str, adapter: AdapterUpdate | None,
                           concurrency: tuple[int, ...], n: int, prompt_len: int, gen_len: int, vocab: int,
                           log=print) -> dict[int, float]:
    """Generated tok/s of HF generate at each concurrency (sequences = prompts * n)."""
    from peft import set_peft_model_state_dict

    from benchmarks.random_base import benchmark_base
    from benchmarks.rollout import random_prompts
    from learner.model import add_lora

    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute = torch.bfloat16 if device == "cuda" else torch.float32
    model = benchmark_base(folder, is_random, peer_format, device, compute)
    if adapter is not None:
        config = adapter.peft_config
        model = add_lora(model, config["r"], config["lora_alpha"], config["target_modules"])
        tensors = decode_adapter(adapter.payload)
        set_peft_model_state_dict(model, {k.replace("base_model.model.", "", 1): v for k, v in tensors.items()})
    model.train(False)
    results = {}
    for seqs in concurrency:
        prompts = torch.tensor(random_prompts(max(1, seqs // n), prompt_len, vocab, seqs), device=device)
        # remove_invalid_values: a NaN logit would end the process in a device-side assert
        # and lose the vLLM figures already measured; it costs two elementwise ops per step
        kwargs = dict(do_sample=True, temperature=1.0, max_new_tokens=gen_len, min_new_tokens=gen_len,
                      num_return_sequences=n, pad_token_id=0, remove_invalid_values=True)
        with torch.no_grad():
            model.generate(prompts[:1], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
            sync_device(device)
            started = time.perf_counter()
            output = model.generate(prompts, **kwargs)
            sync_device(device)
        elapsed = time.perf_counter() - started
        generated = (output.shape[1] - prompts.shape[1]) * output.shape[0]
        results[output.shape[0]] = generated / elapsed
        log(f"[qerl]   HF generate ({peer_format} + peft) {output.shape[0]} seqs: {generated / elapsed:,.1f} tok/s")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return results
