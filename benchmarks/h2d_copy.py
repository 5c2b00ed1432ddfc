"""Host-to-device copy of an adapter-sized buffer: pageable vs pinned staging (GPU only).

    python benchmarks/h2d_copy.py [MEGABYTES]

Why it exists: the adapter push's copy to the GPU was its largest phase (`qerl bench sync`
prints the phases); this shows what a pinned staging buffer buys on the machine at hand.
Prints the median of 10 copies after a warm-up, in ms.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch


def median_ms(copy: Callable[[], object], repeats: int = 10) -> float:
    copy()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[repeats // 2]


def main(megabytes: float) -> None:
    if not torch.cuda.is_available():
        sys.exit("h2d_copy: needs a CUDA device")
    size = int(megabytes * 2**20)
    source = torch.from_numpy(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8))  # pageable
    target = torch.empty(size, dtype=torch.uint8, device="cuda")
    staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def staged() -> None:
        staging.copy_(source)
        target.copy_(staging, non_blocking=True)

    rows = {
        "pageable -> GPU (one copy)": lambda: target.copy_(source),
        "pageable -> pinned (host memcpy)": lambda: staging.copy_(source),
        "pinned -> GPU (DMA)": lambda: target.copy_(staging, non_blocking=True),
        "pinned staging (memcpy + DMA)": staged,
    }
    print(f"{megabytes:g} MB on {torch.cuda.get_device_name()}")
    for name, copy in rows.items():
        print(f"  {name:34s} {median_ms(copy):6.1f} ms")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 154.0)
