"""Where a whole model's time goes with and without the fused blocks: wall time per forward, weight folds per
forward, and the profiler's top CUDA kernels and CPU total, for Inductor and the fusednorm backend.

    PYTHONPATH=. python bench/profile_model.py unet [--plan always]
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

from fusednorm.plans import weights  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--plan", default="always")
    args = ap.parse_args()
    folds = [0]
    fold = weights._fold

    def counting_fold(*a):
        folds[0] += 1
        return fold(*a)

    weights._fold = counting_fold
    title, model, inputs, _ = MODELS[args.model]("cuda", torch.bfloat16)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for label, kw in (("inductor", dict(backend="inductor")),
                      ("fusednorm", dict(backend="fusednorm", options={"plan": args.plan}))):
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
            with torch.profiler.profile(activities=acts) as prof:
                compiled(**inputs)
                torch.cuda.synchronize()
        events = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in events) / 1e3
        print(f"== {title}: {label}: wall {wall_ms:.2f} ms/forward, GPU busy {cuda_total:.2f} ms, "
              f"weight folds per forward {(folds[0] - before) / 10:.1f}", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
