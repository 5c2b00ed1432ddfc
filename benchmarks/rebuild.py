"""`qerl bench rebuild`: the packed 4-bit rebuild alone, per weight shape of a model (GPU only).

The learner rebuilds every packed layer's dense weight in forward and again for the input
gradient (`learner.packed_layers`), so this kernel's time counts at least twice per layer and
micro-batch, and a whole learner step takes minutes to measure. This bench takes seconds: per
format and weight shape it times the learner's own rebuild (`dequantized_weight(dtype)`, the
Triton kernels of `learner.packed_kernels` on a GPU) beside the same reference arithmetic
compiled by `torch.compile` (what the learner ran before the Triton kernels) and in eager
PyTorch, against the memory floor: packed bytes read plus dense bytes written at the copy
bandwidth measured in the same run. The compiled and eager rows are comparisons only.

Each row: device microseconds per call (CUDA events over a loop of calls), the host's
microseconds to issue one call, the share of the floor reached, and whether the weight has the
eager reference's bits; per format and rebuild, the micro-batch total: each shape's calls in one
micro-batch (two per layer: forward and input gradient) times the slower of device and host.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import copy_bandwidth, environment_facts, print_table, resolve_bench_model, write_json
from learner.packed_layers import Int4Linear, Nvfp4Linear, int4_weight, nvfp4_weight
from shared.config import QerlConfig
from shared.errors import QerlError

FORMATS = ("int4", "nvfp4")
CALLS_PER_LAYER = 2  # forward and the input gradient; checkpointing's recompute adds a third


@dataclass(frozen=True)
class RebuildBenchArgs:
    shape: str | None = None
    formats: tuple[str, ...] = FORMATS
    repeats: int = 50
    json: str | None = None


def weight_shapes(folder) -> dict[tuple[int, int], int]:
    """{(out_features, in_features): how many linear layers have that shape} (the head excluded)."""
    from benchmarks.random_adapter import linear_layer_shapes

    return dict(Counter((fan_out, fan_in) for fan_in, fan_out in linear_layer_shapes(folder).values()))


def random_packed_layer(scheme: str, out_features: int, in_features: int, group_size: int,
                        device: str = "cuda") -> torch.nn.Module:
    """A packed layer of random codes and plausible scales on the GPU (bf16 int4 scales, as the
    learner loads a bf16 model's int4 folder)."""
    generator = torch.Generator(device=device).manual_seed(out_features + in_features)
    if scheme == "int4":
        layer = Int4Linear(in_features, out_features, group_size, torch.bfloat16, device=device)
        layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=generator,
                                          dtype=torch.int64, device=device).to(torch.int32))
        layer.scale.copy_(torch.rand(layer.scale.shape, generator=generator, device=device) * 0.02 + 1e-4)
        return layer
    layer = Nvfp4Linear(in_features, out_features, device=device)
    layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=generator, dtype=torch.int32,
                                      device=device).to(torch.uint8))
    layer.scale.copy_((torch.rand(layer.scale.shape, generator=generator, device=device) * 400 + 1)
                      .to(torch.float8_e4m3fn))
    layer.global_scale.fill_(1234.5)
    return layer


def rebuilds(layer: torch.nn.Module, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    """The learner's rebuild and the reference, compiled and eager, each giving the weight in `dtype`."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if isinstance(layer, Int4Linear):
        function = int4_weight
        def arguments():
            return layer.qweight, layer.scale, layer.in_features, layer.group_size
    else:
        function = nvfp4_weight
        def arguments():  # the division by the global scale in eager fp32, as the compiled rebuild kept it
            return layer.qweight, layer.scale.to(torch.float32) / layer.global_scale, dtype
    compiled = torch.compile(function, dynamic=False, fullgraph=True)
    return {"learner": lambda: layer.dequantized_weight(dtype),
            "compiled": lambda: compiled(*arguments()).to(dtype),
            "eager": lambda: function(*arguments()).to(dtype)}


def time_call(call: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float]:
    """(device µs per call, host µs to issue one call): CUDA events around `repeats` calls after a warm-up."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    issued = time.perf_counter()
    for _ in range(repeats):
        call()
    host_us = (time.perf_counter() - issued) / repeats * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3, host_us


def packed_bytes(layer: torch.nn.Module) -> int:
    return sum(buffer.numel() * buffer.element_size() for buffer in layer.buffers())


def bench_rebuild(config: QerlConfig, args: RebuildBenchArgs, log=print) -> dict:
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        raise QerlError(f"--formats {','.join(unknown)}: qerl bench rebuild measures {', '.join(FORMATS)}")
    if not torch.cuda.is_available():
        raise QerlError("qerl bench rebuild needs a CUDA GPU (the CPU runs the reference rebuild only)")
    folder, _ = resolve_bench_model(args.shape, config)
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth("cuda")
    shapes = weight_shapes(folder)
    log(f"[qerl] bench rebuild: {args.shape or folder.name}, {len(shapes)} weight shapes, output {dtype}, "
        f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s")
    rows, table = [], []
    for scheme in args.formats:
        totals: dict[str, float] = {}
        for (out_features, in_features), layers in shapes.items():
            layer = random_packed_layer(scheme, out_features, in_features, config.policy.group_size)
            floor_us = (packed_bytes(layer) + out_features * in_features * dtype.itemsize) / bandwidth * 1e6
            calls_by_name = rebuilds(layer, dtype)
            expected = calls_by_name["eager"]().view(torch.int16)
            for name, call in calls_by_name.items():
                identical = torch.equal(call().view(torch.int16), expected)
                device_us, host_us = time_call(call, args.repeats)
                calls = layers * CALLS_PER_LAYER
                totals[name] = totals.get(name, 0.0) + calls * max(device_us, host_us) / 1e3
                row = {"format": scheme, "rebuild": name, "out_features": out_features, "in_features": in_features,
                       "device_us": device_us, "host_us": host_us, "floor_us": floor_us,
                       "of_floor": floor_us / device_us, "calls_per_micro_batch": calls,
                       "bit_identical_to_eager": identical}
                rows.append(row)
                table.append([scheme, name, f"{out_features}x{in_features}", device_us, host_us, floor_us,
                              f"{row['of_floor']:.0%}", calls, "yes" if identical else "NO"])
            del layer
        for name, total in totals.items():
            log(f"[qerl]   {scheme} {name}: {total:.1f} ms of rebuilds per micro-batch")
            rows.append({"format": scheme, "rebuild": name, "micro_batch_ms": total})
    headers = ["format", "rebuild", "shape", "device us", "host us", "floor us", "of floor", "calls", "= eager"]
    print_table(headers, table, log)
    result = {"benchmark": "rebuild", "args": asdict(args), "group_size": config.policy.group_size,
              "copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows, "environment": environment_facts()}
    write_json(args.json, result, log)
    return result
