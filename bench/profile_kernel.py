"""Run the generated kernel on one benchmark shape a few times, for Nsight Compute or compute-sanitizer.

    ncu --clock-control none --kernel-name regex:pnca_ --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python bench/profile_kernel.py seed [role] [g=G]

With ``eager`` in place of a role it runs eager PyTorch's block instead, so that the same profile of torch's own
attention kernel (``--kernel-name regex:"flash|fmha"``) can be read beside the generated one's. ``g=G`` pins the
heads of one work item (``select.force_heads_per_item``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fusednorm  # noqa: E402
from bench_block import SHAPES, NoProjForm  # noqa: E402
from fusednorm.codegen import select  # noqa: E402


def main(argv):
    name, rest = argv[0], [a for a in argv[1:] if not a.startswith("g=")]
    for a in argv[1:]:
        if a.startswith("g="):
            select.force_heads_per_item = int(a[2:])
    eager = bool(rest) and rest[0] == "eager"
    if rest and not eager:
        select.force_role = rest[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    form = NoProjForm()
    t = form.make_inputs(SHAPES[name], torch.bfloat16, gen)
    for _ in range(4):
        if eager:
            y = form.eager(**t)
        else:
            y = fusednorm.fused_pre_norm_cross_attn(t["x"], t["k"], t["v"], t["gamma"], t["beta"], 1e-5)
    torch.cuda.synchronize()
    print(name, tuple(y.shape), bool(torch.isfinite(y).all()))


if __name__ == "__main__":
    main(sys.argv[1:])
