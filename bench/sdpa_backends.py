"""Each of torch's SDPA backends against float64 on one attention shape, for both signs of the scale.

    python bench/sdpa_backends.py [--shape B,H,Lq,Lk,d] [--scale 0.05]

Why: the GPU tests' eager baseline (tests/gpu/test_kernel_gpu.py, eager_block) runs a negative scale through the
math backend only: on an H100 with torch 2.11 the flash and cuDNN backends returned NaN for scale -0.05 (fp16 and
bf16; efficient and math were finite; docs/PERF.md, thirty-ninth run).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,3,130,1250,64")
    ap.add_argument("--scale", type=float, default=0.05)
    args = ap.parse_args()
    B, H, Lq, Lk, d = (int(n) for n in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(B, H, Lq, d, device="cuda", generator=gen).to(dtype)
        k = torch.randn(B, H, Lk, d, device="cuda", generator=gen).to(dtype)
        v = torch.randn(B, H, Lk, d, device="cuda", generator=gen).to(dtype)
        for scale in (-args.scale, args.scale):
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
            for backend in BACKENDS:
                try:
                    with sdpa_kernel(backend):
                        y = F.scaled_dot_product_attention(q, k, v, scale=scale)
                except RuntimeError as e:  # a backend that does not take this shape or dtype
                    print(f"{str(dtype):15s} scale {scale:+.3f} {backend.name:20s} not run: {str(e)[:80]}")
                    continue
                err = ((y.double() - ref).norm() / ref.norm()).item()
                finite = bool(torch.isfinite(y).all())
                print(f"{str(dtype):15s} scale {scale:+.3f} {backend.name:20s} finite {finite!s:5s} rel err {err:.2e}")


if __name__ == "__main__":
    main()
