"""`qerl bench lora-kernels`: tune vLLM's LoRA Triton kernels for one model shape on this GPU.

vLLM launches its LoRA shrink (x @ A) and expand (@ B, added to the output) kernels with
generic launch configs unless VLLM_TUNED_CONFIG_FOLDER holds configs for the GPU, and it ships
none. These kernels are most of what an adapter adds to a decode step (the profiled figures
are in BENCHMARKS.md, fifth run).

For each kernel, LoRA'd linear layer and token count this times a small grid of launch configs
the way vLLM runs decode (calls captured in one CUDA graph, replayed), drops any candidate whose
output differs from the default's, and writes the winners where `rollout.lora_kernel_configs`
(and `qerl bench rollout --lora-kernel-configs`) point vLLM. The files are read back through
vLLM's own loader before they replace anything. It prints the LoRA kernel time per decode step,
default vs tuned.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import environment_facts, print_table, resolve_bench_model, write_json
from shared.config import QerlConfig
from shared.errors import QerlError

# Launch configs tried besides vLLM's default: (block_m, block_n, block_k, split_k, num_warps, num_stages).
# Small blocks and deep K splits suit decode (few tokens, long K); the 128-row ones suit prefill.
SHRINK_GRID = [
    (16, 32, 32, 32, 4, 2), (16, 32, 64, 16, 4, 2), (16, 32, 64, 32, 4, 2), (16, 32, 128, 8, 4, 2),
    (16, 32, 128, 16, 4, 2), (16, 32, 256, 8, 4, 2), (16, 16, 256, 16, 4, 2), (32, 16, 128, 16, 4, 2),
    (32, 32, 64, 16, 4, 2), (32, 32, 128, 16, 4, 2), (64, 32, 64, 16, 4, 2), (64, 32, 64, 32, 4, 2),
    (64, 32, 128, 8, 4, 2), (64, 32, 128, 16, 4, 2), (64, 32, 128, 16, 4, 3), (64, 32, 256, 4, 4, 2),
    (128, 32, 64, 8, 4, 2), (128, 32, 128, 4, 8, 2),
]
# (block_m, block_n, block_k, num_warps, num_stages); expand's K is the LoRA rank.
EXPAND_GRID = [
    (16, 64, 32, 4, 2), (16, 128, 32, 4, 2), (16, 256, 32, 4, 2), (16, 128, 16, 4, 2),
    (32, 64, 32, 4, 2), (32, 128, 32, 4, 2), (32, 256, 32, 8, 2), (64, 64, 32, 4, 3),
    (64, 128, 32, 4, 2), (64, 256, 32, 8, 2), (128, 64, 32, 4, 2), (128, 128, 32, 8, 2),
]


def _candidates(op: str) -> list[dict]:
    if op == "shrink":
        names = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
        return [dict(zip(names, values)) for values in SHRINK_GRID]
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    return [dict(zip(names, values)) for values in EXPAND_GRID]


@dataclass(frozen=True)
class LoraKernelBenchArgs:
    shape: str | None = None
    tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 2048, 8192)
    """Tokens per kernel call: decode batch sizes (sequences in flight) and prefill chunks."""
    out: str = "configs/lora-kernels"
    json: str | None = None


@dataclass(frozen=True)
class LoraLinear:
    """One LoRA'd linear group of a decoder layer as vLLM packs it (qkv and gate_up: slices)."""

    name: str
    fan_in: int
    fan_outs: tuple[int, ...]


def lora_linears(folder: Path) -> tuple[list[LoraLinear], int]:
    """The LoRA'd linear groups of one decoder layer, and the number of layers."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    linears = [
        LoraLinear("qkv_proj", hidden, (q, kv, kv)),
        LoraLinear("o_proj", q, (hidden,)),
        LoraLinear("gate_up_proj", hidden, (inner, inner)),
        LoraLinear("down_proj", inner, (hidden,)),
    ]
    return linears, config.num_hidden_layers


def time_per_call_us(call: Callable[[], None], calls: int = 20, replays: int = 5) -> float:
    """Device time of one call, as in a CUDA-graph replay (no Python launch cost)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def _output_of(kernel) -> torch.Tensor:
    kernel.output.zero_()  # expand adds into it
    kernel()
    return kernel.output.clone()


def tune_kernel(kernel) -> dict:
    """vLLM's default launch config for `kernel` and the fastest candidate with the same output."""
    key = kernel.lookup_key()
    with kernel.config(None):
        reference = _output_of(kernel)
        default_us = time_per_call_us(kernel)
    default = dict(kernel.module.get_lora_op_configs(**key))
    best, best_us = default, default_us
    scale = float(reference.abs().max()) or 1.0
    for overrides in _candidates(kernel.op):
        candidate = {**default, **overrides}
        if candidate == default:
            continue
        with kernel.config(candidate):
            try:
                output = _output_of(kernel)
                if not torch.allclose(output.float(), reference.float(), rtol=2e-2, atol=1e-2 * scale):
                    continue  # a config that computes something else is no speed-up
                elapsed = time_per_call_us(kernel)
            except Exception:  # e.g. Triton out of shared memory for this block shape
                continue
        if elapsed < best_us:
            best, best_us = candidate, elapsed
    return {"key": key, "default": default, "default_us": default_us, "best": best, "best_us": best_us}


def config_files(results: list[dict], gpu: str) -> dict[str, dict]:
    """File name -> nested config, in vLLM's layout [max_loras][num_slices][m][k][n]; `gpu` is
    the device name as vLLM spells it in file names (NVIDIA_H200)."""
    files: dict[str, dict] = {}
    for result in results:
        key = result["key"]
        if key["op_type"] == "shrink":
            name, k, n = f"{gpu}_SHRINK.json", key["hidden_size"], key["rank"]
        else:
            name, k, n = f"{gpu}_EXPAND_{str(key['add_inputs']).upper()}.json", key["rank"], key["hidden_size"]
        node = files.setdefault(name, {})
        for level in (key["max_loras"], key["num_slices"], key["batch"], k):
            node = node.setdefault(str(level), {})
        node[str(n)] = result["best"]
    return files


def _merged(old: dict, new: dict) -> dict:
    merged = dict(old)
    for key, value in new.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def write_config_files(results: list[dict], out: Path) -> list[Path]:
    """Merge the winners into the files under `out` (other shapes' entries stay), after
    checking in a scratch folder that vLLM's loader finds every winner."""
    from benchmarks.vllm_lora_kernels import tuned_lora_config

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".qerl-lora-kernels-", dir=out) as scratch:
        gpu = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
        for name, tree in config_files(results, gpu).items():
            existing = out / name
            try:
                old = json.loads(existing.read_text()) if existing.is_file() else {}
            except json.JSONDecodeError as error:
                raise QerlError(f"{existing} is not valid JSON ({error}); move it away and run again") from error
            (Path(scratch) / name).write_text(json.dumps(_merged(old, tree), indent=1, sort_keys=True) + "\n")
        for result in results:
            found = tuned_lora_config(scratch, result["key"])
            if any(found.get(name) != value for name, value in result["best"].items()):
                raise QerlError(
                    f"this vLLM reads LoRA kernel configs differently from what qerl writes (lookup "
                    f"{result['key']} found {found}); nothing written to {out}"
                )
        written = []
        for file in sorted(Path(scratch).glob("*.json")):
            shutil.move(str(file), out / file.name)
            written.append(out / file.name)
    return written


def bench_lora_kernels(config: QerlConfig, args: LoraKernelBenchArgs, log=print) -> dict:
    if not torch.cuda.is_available():
        raise QerlError("qerl bench lora-kernels tunes vLLM's CUDA kernels: it needs a CUDA GPU")
    from benchmarks.vllm_lora_kernels import LoraKernel
    from rollout_server.vllm_internals import vllm_line

    vllm_line()
    folder, _ = resolve_bench_model(args.shape, config)
    linears, layers = lora_linears(folder)
    rank = config.lora.rank
    log(f"[qerl] bench lora-kernels: {folder.name}, LoRA r{rank}, {torch.cuda.get_device_name()}, "
        f"tokens {','.join(map(str, args.tokens))}; {len(SHRINK_GRID)} shrink and {len(EXPAND_GRID)} expand "
        f"candidates each (first compiles take a while)")
    results, by_key, per_step = [], {}, {}
    for tokens in args.tokens:
        default_step = tuned_step = 0.0
        for linear in linears:
            for op in ("shrink", "expand"):
                kernel = LoraKernel(op, tokens, linear.fan_in, linear.fan_outs, rank)
                identity = json.dumps(kernel.lookup_key(), sort_keys=True)
                if identity not in by_key:  # o_proj and down_proj expand into the same shape
                    by_key[identity] = tune_kernel(kernel)
                    results.append(by_key[identity])
                result = by_key[identity]
                default_step += result["default_us"] * layers
                tuned_step += result["best_us"] * layers
                log(f"[qerl]   {tokens:>5} tokens  {op:<6} {linear.name:<12} default {result['default_us']:7.1f} us"
                    f"  tuned {result['best_us']:7.1f} us")
        per_step[tokens] = {"default_us": default_step, "tuned_us": tuned_step}
    written = write_config_files(results, Path(args.out))
    print_table(
        ["tokens", "LoRA us/step default", "tuned", "speed-up"],
        [[t, v["default_us"], v["tuned_us"], v["default_us"] / v["tuned_us"]] for t, v in per_step.items()],
        log,
    )
    log(f"[qerl] wrote {', '.join(str(p) for p in written)}; use them with rollout.lora_kernel_configs={args.out}")
    report = {"args": asdict(args) | {"tokens": list(args.tokens)}, "lora_rank": rank, "layers": layers,
              "per_step_us": {str(t): v for t, v in per_step.items()}, "kernels": results,
              "files": [str(p) for p in written], "environment": environment_facts()}
    write_json(args.json, report, log)
    return report
