"""Does the default ``kernel="auto"`` pick the faster of the generated kernel and Inductor? One run, bf16.

    PYTHONPATH=. python bench/kernel_choice.py --out bench/out [--shapes seed,lk2048,...]

For each projection-free shape (the block benchmark's, plus shapes around and above the ridge where the block
stops being memory-bound): GPU time of eager, Inductor, the generated kernel (``fused_pre_norm_cross_attn``) and
the block compiled with ``backend="fusednorm"`` and default options, what that compile chose and why (the
report's words), and its time over the faster of kernel and Inductor ("regret": 1.00 when it chose right). GPU
times as in bench_block.py (median of CUDA-graph replay windows). Writes kernel_choice.json under --out and
prints a markdown table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block import NoProjForm, graph_time_us, input_sets_for, rel_diff  # noqa: E402

from fusednorm.plans import choose  # noqa: E402
from fusednorm.report import Report  # noqa: E402

# name: (B, Lq, D, H, Lk); FLOP/byte (bf16, no mask) = Lq * Lk / (Lq + Lk)
SHAPES = {
    **NoProjForm.shapes,
    "lk128": (32, 2048, 1024, 16, 128),               # 120: between few keys and the ridge
    "lk192": (32, 2048, 1024, 16, 192),               # 176: just under the ridge
    "lk256": (32, 2048, 1024, 16, 256),               # 228: just over it
    "sd15_lk256_d40": (8, 4096, 320, 8, 256),         # 241: head dim 40
    "lk512": (16, 2048, 1024, 16, 512),               # 410
    "sq1024": (16, 1024, 1024, 16, 1024),             # 512
    "whisper_pre_1792": (16, 1792, 1280, 20, 1500),   # 817
    "pre_d128": (16, 448, 1024, 8, 1500),             # 345: head dim 128
    "sq2048_d128": (8, 2048, 2048, 16, 2048),         # 1024: head dim 128
    "dec_b1": (1, 1, 1280, 20, 1500),                 # 1: decode at small batch, few (batch, head) pairs
    "dec_b4": (4, 1, 1280, 20, 1500),                 # 1
    "dec_b16": (16, 1, 1280, 20, 1500),               # 1
    "dec_base_b1": (1, 1, 512, 8, 1500),              # 1: Whisper-base
    "sdxl32_b1": (1, 1024, 1280, 20, 77),             # 72: few keys at batch 1
    "sd15_64_b1": (1, 4096, 320, 8, 77),              # 76
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all): " + ",".join(SHAPES))
    args = ap.parse_args(argv)
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"no shape {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    form, dtype = NoProjForm(), torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)

    rows = []
    for name in names:
        shape = SHAPES[name]
        sets = input_sets_for(form, shape, dtype, gen, l2_bytes)
        torch._dynamo.reset()  # every shape compiles afresh: no recompile limit, no earlier choice reused
        report = Report()
        default = torch.compile(form.eager, backend="fusednorm", dynamic=False, options={"report": report})
        inductor = torch.compile(form.eager, dynamic=False)
        row = dict(name=name, shape=dict(zip("B Lq D H Lk".split(), shape)),
                   flop_per_byte=choose.flop_per_byte(dict(sets[0], mask=None)))
        row["eager_us"] = graph_time_us(form.eager, sets)
        row["inductor_us"] = graph_time_us(inductor, sets)
        row["kernel_us"] = graph_time_us(form.fused, sets)
        row["default_us"] = graph_time_us(default, sets)
        row["default_fused"] = bool(report.matches)
        row["default_why"] = (report.matches[0].runs if report.matches
                              else "; ".join(n.reason for n in report.near_misses) or "nothing matched")
        row["default_vs_eager_rel_diff"] = rel_diff(default(**sets[0]), form.eager(**sets[0]))
        row["regret"] = row["default_us"] / min(row["inductor_us"], row["kernel_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = dict(date=datetime.date.today().isoformat(), device=props.name, torch=torch.__version__,
                      ridge_flop_per_byte=choose.ridge_flop_per_byte(props.major * 10 + props.minor),
                      margin=choose.MARGIN, shapes=rows)
        (args.out / "kernel_choice.json").write_text(json.dumps(result, indent=1))  # after each shape: a time
        del sets, default, inductor                                                  # limit keeps what ran
        torch.cuda.empty_cache()

    print("\n| shape (B, Lq, D, H, Lk) | FLOP/byte | eager | Inductor | kernel | default | default ran | regret |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["shape"]
        ran = "kernel" if r["default_fused"] else "Inductor"
        timed = " (timed)" if "timed" in r["default_why"] else ""
        print(f"| {r['name']} ({s['B']}, {s['Lq']}, {s['D']}, {s['H']}, {s['Lk']}) | {r['flop_per_byte']:.0f} | "
              f"{r['eager_us']:.1f} | {r['inductor_us']:.1f} | {r['kernel_us']:.1f} | {r['default_us']:.1f} | "
              f"{ran}{timed} | {r['regret']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
