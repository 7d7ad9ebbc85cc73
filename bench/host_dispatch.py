"""What the dispatcher's autograd key costs one call of the fused op, on this machine's CPU (no GPU needed).

    PYTHONPATH=. python bench/host_dispatch.py [--device cpu|cuda]

What the device's implementation calls is replaced by an allocation of the output, so what is timed is the way
from ``torch.ops.fusednorm.pre_norm_cross_attn`` to it: through fusednorm's autograd kernel (a plain call goes
straight to the device's implementation) and through custom_op's (what every call paid before: a Python kernel
that redispatches below autograd); for scale, the device's implementation called as a function (the eager route of
``fused_pre_norm_cross_attn``). µs per call, median of windows, interleaved so that drift hits all three.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fusednorm import dispatch, op

KEYS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}


def per_call_us(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=sorted(KEYS), default="cpu")
    ap.add_argument("--windows", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5000, help="calls per window")
    opts = ap.parse_args(argv)
    device, key = opts.device, KEYS[opts.device]
    x = torch.randn(2, 8, 64, device=device)
    k = v = torch.randn(2, 8, 4, 8, device=device).transpose(1, 2)
    w = torch.randn(64, 64, device=device, requires_grad=True)  # a parameter, as a model's weights are
    args = (x, k, v, None, None, w, None, w, None, None, "layer", 1e-5)
    call = torch.ops.fusednorm.pre_norm_cross_attn.default

    def allocate_only(x, *rest):
        return torch.empty_like(x)

    # what the device's implementation calls, replaced by an allocation, so that every route ends in the same work
    stubs = {"cuda": [(dispatch, "run_cuda_cached", allocate_only)],
             "cpu": [(op, "check_inputs", lambda *a: None), (op, "reference_pre_norm_cross_attn", allocate_only)]}
    saved = [(module, name, getattr(module, name)) for module, name, _ in stubs[device]]
    for module, name, stub in stubs[device]:
        setattr(module, name, stub)
    device_impl = op.DEVICE_IMPLS[key]
    plain, direct, layered = [], [], []
    try:
        with torch.no_grad():  # as a compiled graph's forward runs
            for _ in range(opts.windows):
                plain.append(per_call_us(lambda: device_impl(*args), opts.calls))
                direct.append(per_call_us(lambda: call(*args), opts.calls))
                del op.DEVICE_IMPLS[key]  # no direct entry: custom_op's autograd kernel, then the device key
                layered.append(per_call_us(lambda: call(*args), opts.calls))
                op.DEVICE_IMPLS[key] = device_impl
    finally:
        op.DEVICE_IMPLS[key] = device_impl
        for module, name, real in saved:
            setattr(module, name, real)
    print(f"torch {torch.__version__}, {device}: one call through the dispatcher to an implementation that only "
          f"allocates its output")
    print(f"  the device's implementation called as a function (no dispatcher): {statistics.median(plain):.2f} us")
    print(f"  fusednorm's autograd kernel (a plain call goes straight to the device's implementation): "
          f"{statistics.median(direct):.2f} us")
    print(f"  custom_op's autograd kernel (redispatches below autograd): {statistics.median(layered):.2f} us")


if __name__ == "__main__":
    main()
