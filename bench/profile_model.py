"""Where a whole model's time goes with and without the fused blocks: wall time per forward, weight folds per
forward, and the profiler's top CUDA kernels and CPU total, for Inductor and the fusednorm backend.

    PYTHONPATH=. python bench/profile_model.py unet [--plans never,always] [--block-kernels]

``--plans``: one fusednorm variant per plan option. ``--block-kernels``: also the kernels the measured choice
(plan="measure") times the compiler on for the model's first measured block (plans/choose.py), so that the block
as the choice sees it can be set beside the same block inside the model.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MODELS  # noqa: E402

from fusednorm.plans import choose, weights  # noqa: E402

ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def print_kernels(title, fn, rows=14):
    """One call of ``fn`` under the profiler: its GPU busy time and top kernels."""
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"== {title}: GPU busy {cuda_total:.3f} ms", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60), flush=True)


def profiling_compiler_block():
    """choose.compiler_block, printing the kernels of the first block it compiles (one call, after warm-up)."""
    real, shown = choose.compiler_block, []

    def compiler_block(*args, **kwargs):
        compiled, inputs, note = real(*args, **kwargs)
        if not shown:
            shown.append(True)
            for _ in range(3):
                compiled(*inputs)
            print_kernels(f"the compiler's block as the measured choice times it{note}", lambda: compiled(*inputs))
        return compiled, inputs, note

    return compiler_block


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--plans", default="always", help="comma-separated plan options, one fusednorm variant each")
    ap.add_argument("--block-kernels", action="store_true")
    args = ap.parse_args()
    folds = [0]
    fold = weights._fold

    def counting_fold(*a):
        folds[0] += 1
        return fold(*a)

    weights._fold = counting_fold
    if args.block_kernels:
        choose.compiler_block = profiling_compiler_block()
    title, model, inputs, _ = MODELS[args.model]("cuda", torch.bfloat16)
    variants = [("inductor", dict(backend="inductor"))]
    variants += [(f"fusednorm plan={p}", dict(backend="fusednorm", options={"plan": p}))
                 for p in args.plans.split(",")]
    for label, kw in variants:
        torch._dynamo.reset()
        compiled = torch.compile(model, **kw)
        with torch.no_grad():
            for _ in range(3):
                compiled(**inputs)
            torch.cuda.synchronize()
            before = folds[0]
            t0 = time.perf_counter()
            for _ in range(10):
                compiled(**inputs)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) / 10 * 1e3
            print_kernels(f"{title}: {label}: wall {wall_ms:.2f} ms/forward, weight folds per forward "
                          f"{(folds[0] - before) / 10:.1f}", lambda: compiled(**inputs))


if __name__ == "__main__":
    main()
