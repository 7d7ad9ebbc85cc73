"""Run one small configuration of each tile role of the generated kernel, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python tests/gpu/sanitize_kernels.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize_kernels.py

Covers every tile role (short / base / long / many_keys / many_keys_fine / few_keys) of templates/pnca/ (kernel.cu
and, on sm_90, kernel_ws.cu), the padded head dim (40), the largest (256), a bool and an additive mask, ragged
lengths, rows whose mean is large against their spread (the exact statistics pass), statistics shared between a row
block's items, one SM's worth of CTAs (several items each) and keys split between CTAs (decode at batch 1), so every
code path of the template runs once; then the projection plan's stage mode (folded Q in, o and its ones column out)
once per role (the warp-specialised kernel's too).
"""
from __future__ import annotations

import sys

import torch

import fusednorm
from fusednorm.codegen import launch, select

CASES = [  # (role, dtype, B, Lq, Lk, H, d, mask, mean of x in units of its std[, sm_count])
    ("short", torch.bfloat16, 2, 1, 150, 2, 64, None, 0.0),
    ("short", torch.bfloat16, 2, 3, 150, 2, 64, None, 50.0),
    ("short", torch.float16, 1, 5, 77, 2, 256, "bool", 0.0),
    ("short", torch.float16, 1, 2, 300, 2, 128, None, 0.0),  # swizzled stages, the partial states merged in one
    ("short", torch.bfloat16, 2, 1, 700, 3, 64, "bool", 0.0, 1),  # several heads and stages per CTA
    ("short", torch.bfloat16, 1, 1, 1500, 4, 64, "bool", 0.0),  # keys split between CTAs, merged by the last
    ("base", torch.bfloat16, 2, 70, 77, 2, 40, "add", 0.0),
    ("base", torch.float16, 1, 33, 19, 2, 256, None, 0.0),
    ("base", torch.bfloat16, 1, 70, 100, 2, 128, "bool", 0.0),  # sm_90: the warpgroup mma (d 64 and 128)
    ("long", torch.bfloat16, 1, 130, 300, 2, 64, "bool", 0.0),
    ("long", torch.bfloat16, 1, 129, 100, 2, 128, None, 0.0),
    ("many_keys", torch.bfloat16, 1, 130, 250, 2, 64, "bool", 0.0),  # sm_90: 112-key stages, the last partial
    # sm_90 without a mask: the warp-specialised kernel (kernel_ws.cu), one warpgroup past Lq, a last tile of 6 keys
    ("many_keys", torch.bfloat16, 1, 129, 1030, 2, 64, None, 0.0),
    ("many_keys", torch.float16, 2, 200, 300, 3, 64, None, 50.0, 1),  # many items per CTA: the rings wrap
    ("many_keys_fine", torch.bfloat16, 2, 129, 1030, 3, 64, None, 0.0, 1),  # its 96-key stages, 4 of them
    # D = 768 in 12 heads, 24 items at once: each sums one column group of its rows' statistics and takes the other
    # items' (statistics.cu)
    ("long", torch.bfloat16, 1, 130, 300, 12, 64, "bool", 0.0),
    ("few_keys", torch.bfloat16, 2, 140, 77, 3, 64, "add", 0.0),
    ("few_keys", torch.bfloat16, 1, 40, 77, 3, 64, "add", 50.0),
    ("few_keys", torch.float16, 1, 20, 80, 2, 40, None, 0.0),
    # one SM's worth of CTAs: each works through several items, its pipeline running on across them
    ("few_keys", torch.bfloat16, 2, 300, 77, 3, 64, "bool", 0.0, 1),
    ("few_keys", torch.bfloat16, 2, 300, 77, 2, 32, None, 50.0, 1),
]


def main() -> int:
    torch.manual_seed(0)
    for role, dtype, B, Lq, Lk, H, d, mask_kind, mean, *sm_count in CASES:
        select.force_role = role
        x = (torch.randn(B, Lq, H * d, device="cuda") + mean).to(dtype)
        k = torch.randn(B, Lk, H, d, device="cuda", dtype=dtype).transpose(1, 2)
        v = torch.randn(B, Lk, H, d, device="cuda", dtype=dtype).transpose(1, 2)
        g = torch.randn(H * d, device="cuda", dtype=dtype)
        b = torch.randn(H * d, device="cuda", dtype=dtype)
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(B, 1, 1, Lk, device="cuda") > 0.3
        elif mask_kind == "add":
            mask = torch.randn(B, 1, Lq, Lk, device="cuda", dtype=dtype)
        before = launch.launch_count
        y = fusednorm.fused_pre_norm_cross_attn(x, k, v, g, b, 1e-5, *sm_count, mask=mask)
        torch.cuda.synchronize()
        assert launch.launch_count == before + 1
        print(f"{role:14s} {str(dtype):15s} B={B} Lq={Lq} Lk={Lk} H={H} d={d} mask={mask_kind} mean={mean}: "
              f"sm_count={sm_count[0] if sm_count else None}: finite={bool(torch.isfinite(y).all())}")
    for role, B, Lq, Lk, H, d in (("short", 2, 1, 150, 2, 64), ("short", 1, 1, 700, 2, 64), ("base", 2, 70, 77, 2, 40),
                                  ("long", 1, 130, 300, 2, 64), ("few_keys", 2, 100, 77, 2, 64),
                                  ("many_keys_fine", 2, 150, 1030, 2, 64)):  # sm_90: kernel_ws.cu, a warpgroup idle
        select.force_role = role
        D = H * d
        r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        x, k, v = r(B, Lq, D), r(B, Lk, H, d).transpose(1, 2), r(B, Lk, H, d).transpose(1, 2)
        before = launch.launch_count
        y = torch.ops.fusednorm.pre_norm_cross_attn(x, k, v, 1 + 0.1 * r(D), 0.1 * r(D), r(D, D) / D**0.5, r(D),
                                                    r(D, D) / D**0.5, r(D), None, "layer", 1e-5)
        torch.cuda.synchronize()
        assert launch.launch_count == before + 1
        print(f"plan {role:8s} B={B} Lq={Lq} Lk={Lk} H={H} d={d}: finite={bool(torch.isfinite(y).all())}")
    select.force_role = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
