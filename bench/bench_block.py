"""Time one pre-norm cross-attention block: eager PyTorch, torch.compile (Inductor) and fusednorm, against the floor.

    PYTHONPATH=. python bench/bench_block.py --form noproj --out bench/out
    PYTHONPATH=. python bench/bench_block.py --form proj --out bench/out

For each shape of the form's table, in one run: GPU time of each implementation per call (``graph_time_us``: a
CUDA graph holding one call per input set, several input sets rotating when one set would sit in L2; windows of
back-to-back replays timed with events behind a GPU spin, so the host's submission latency is not counted; median
over windows), the floor max(bytes / copy bandwidth, FLOPs / matmul rate) with both ceilings measured in the same
run, achieved GB/s and % of floor, and whether the generated kernel ran. For the noproj form also the host overhead
of one eager-mode call of ``fusednorm.fused_pre_norm_cross_attn`` (wall clock, no graph, small shape). Writes
``bench_<form>.json`` and ``bench_<form>.png`` into --out and prints a markdown table last.

A form is the block's variant, with its own shapes and targets: ``noproj`` is x + MHA(norm(x), k, v); ``proj``
adds the Q and out projections (Wq/bq, Wo/bo; eager = layer_norm -> linear -> SDPA -> linear + x). Another form
plugs in by subclassing ``Form`` and adding it to ``FORMS``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fusednorm  # noqa: E402
from fusednorm import codegen  # noqa: E402
from fusednorm.codegen import launch, select  # noqa: E402
from fusednorm.codegen.spec import TILE_ROLES  # noqa: E402
from fusednorm.plans.weights import GraphWeights  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Form:
    """One variant of the block: its shapes and targets, how to make its inputs, run it eagerly / fused, and count
    its bytes and FLOPs."""

    name = ""
    shapes: dict = {}  # name: (B, Lq, D, H, Lk)
    target_us: dict = {}  # name: GPU µs per call the fused block should reach

    def make_inputs(self, shape, dtype, gen) -> dict:
        """Random inputs on ``gen``'s device."""
        raise NotImplementedError

    def eager(self, **t):
        raise NotImplementedError

    def fused(self, **t):
        raise NotImplementedError

    def expects_kernel(self, shape) -> bool:
        """Whether the fused path should launch the generated kernel on this shape (then the bench asserts it)."""
        return False

    def bytes_moved(self, shape, dtype) -> int:
        raise NotImplementedError

    def flops(self, shape) -> int:
        raise NotImplementedError


def _qkv_inputs(shape, dtype, gen):
    """x [B, Lq, D]; k/v made as [B, Lk, H, d] and viewed as [B, H, Lk, d] (the layout models hand over)."""
    B, Lq, D, H, Lk = shape
    d, dev = D // H, gen.device
    return dict(
        x=torch.randn(B, Lq, D, device=dev, generator=gen).to(dtype),
        k=torch.randn(B, Lk, H, d, device=dev, generator=gen).to(dtype).transpose(1, 2),
        v=torch.randn(B, Lk, H, d, device=dev, generator=gen).to(dtype).transpose(1, 2),
        gamma=(1 + 0.1 * torch.randn(D, device=dev, generator=gen)).to(dtype),
        beta=(0.1 * torch.randn(D, device=dev, generator=gen)).to(dtype),
    )


class NoProjForm(Form):
    """y = x + MHA(layer_norm(x) split into heads, k, v); k/v arrive as [B, Lk, H, d] viewed as [B, H, Lk, d] (and a
    mask, if the inputs carry one: PaddedForm)."""

    name = "noproj"
    shapes = {
        "seed": (32, 2048, 1024, 16, 77),
        "sdxl64": (2, 4096, 640, 10, 77),
        "sd15_64": (8, 4096, 320, 8, 77),
        "t5_dec": (32, 128, 1024, 16, 512),
        "whisper_dec": (64, 1, 1280, 20, 1500),
        "whisper_pre": (16, 448, 1280, 20, 1500),
        "seed_lk2048": (32, 2048, 1024, 16, 2048),
    }
    target_us = {"seed": 80, "sdxl64": 8, "sd15_64": 14, "t5_dec": 26, "whisper_dec": 125, "whisper_pre": 120,
                 "seed_lk2048": 1240}

    def make_inputs(self, shape, dtype, gen):
        return _qkv_inputs(shape, dtype, gen)

    def eager(self, x, k, v, gamma, beta, mask=None):
        B, Lq, D = x.shape
        H, d = k.shape[1], k.shape[3]
        h = F.layer_norm(x, (D,), gamma, beta, 1e-5)
        a = F.scaled_dot_product_attention(h.view(B, Lq, H, d).transpose(1, 2), k, v, attn_mask=mask)
        return x + a.transpose(1, 2).reshape(B, Lq, D)

    def fused(self, x, k, v, gamma, beta, mask=None):
        return fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma, beta, 1e-5, mask=mask)

    def expects_kernel(self, shape):
        return True  # every head dim in the table (64) has a generated kernel

    def bytes_moved(self, shape, dtype):
        B, Lq, D, H, Lk = shape
        e = torch.finfo(dtype).bits // 8
        return e * (2 * B * Lq * D + 2 * B * Lk * D + 2 * D)  # x read, y written, k, v, gamma, beta

    def flops(self, shape):
        B, Lq, D, H, Lk = shape
        return 4 * B * Lq * Lk * D  # QK^T and PV: 2 * 2 * B * H * Lq * Lk * d


class ProjForm(Form):
    """y = x + linear(MHA(linear(layer_norm(x), Wq, bq) split into heads, k, v) merged, Wo, bo); Dq = D = H * d."""

    name = "proj"
    shapes = {
        "seed": (32, 2048, 1024, 16, 77),
        "sdxl64": (2, 4096, 640, 10, 77),
        "sdxl32": (2, 1024, 1280, 20, 77),
        "sd15_64": (8, 4096, 320, 8, 77),
        "whisper_pre": (16, 448, 1280, 20, 1500),
        "whisper_dec": (64, 1, 1280, 20, 1500),
        "t5_dec": (32, 128, 1024, 16, 512),
    }
    target_us = {"seed": 450, "sdxl64": 29, "sdxl32": 28, "sd15_64": 40, "whisper_pre": 190, "whisper_dec": 125,
                 "t5_dec": 45}

    def make_inputs(self, shape, dtype, gen):
        D, dev = shape[2], gen.device
        t = _qkv_inputs(shape, dtype, gen)
        std = D ** -0.5  # keeps q and the block's output at the scale of x
        for w, b in (("wq", "bq"), ("wo", "bo")):
            t[w] = (std * torch.randn(D, D, device=dev, generator=gen)).to(dtype)
            t[b] = (0.1 * torch.randn(D, device=dev, generator=gen)).to(dtype)
        return t

    def eager(self, x, k, v, gamma, beta, wq, bq, wo, bo):
        B, Lq, D = x.shape
        H, d = k.shape[1], k.shape[3]
        h = F.layer_norm(x, (D,), gamma, beta, 1e-5)
        q = F.linear(h, wq, bq).view(B, Lq, H, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v)
        return x + F.linear(a.transpose(1, 2).reshape(B, Lq, H * d), wo, bo)

    def fused(self, x, k, v, gamma, beta, wq, bq, wo, bo):
        # schema: x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps
        return torch.ops.fusednorm.pre_norm_cross_attn(x, k, v, gamma, beta, wq, bq, wo, bo, None, "layer", 1e-5)

    def expects_kernel(self, shape):
        return True  # the projection plan's attention stage is the generated kernel (fusednorm/plans)

    def bytes_moved(self, shape, dtype):
        B, Lq, D, H, Lk = shape
        e = torch.finfo(dtype).bits // 8
        # x read, y written, k, v, Wq and Wo, gamma, beta, bq, bo
        return e * (2 * B * Lq * D + 2 * B * Lk * D + 2 * D * D + 4 * D)

    def flops(self, shape):
        B, Lq, D, H, Lk = shape
        return 2 * (2 * B * Lq * D * D) + 4 * B * Lq * Lk * D  # Q and out GEMMs, QK^T and PV


class PaddedForm(NoProjForm):
    """noproj with the encoder's key-padding mask, as T5 and mBART hand it to their cross-attention: bool
    [B, 1, 1, Lk], each batch item keeping its first 3/4 to all of the keys (the long-key shapes: where the mask
    decides between kernel_ws.cu and kernel.cu)."""

    name = "noproj_padded"
    shapes = {n: NoProjForm.shapes[n] for n in ("t5_dec", "whisper_pre", "seed_lk2048")}
    target_us = {}  # the issues' targets are for blocks without a mask

    def make_inputs(self, shape, dtype, gen):
        B, Lk = shape[0], shape[4]
        keep = torch.randint(Lk * 3 // 4, Lk + 1, (B,), device=gen.device, generator=gen)
        mask = (torch.arange(Lk, device=gen.device)[None, :] < keep[:, None])[:, None, None, :]
        return dict(_qkv_inputs(shape, dtype, gen), mask=mask)  # eager and fused take it as an argument

    def bytes_moved(self, shape, dtype):
        return super().bytes_moved(shape, dtype) + shape[0] * shape[4]  # and the mask's bytes


FORMS = {"noproj": NoProjForm, "proj": ProjForm, "noproj_padded": PaddedForm}
SHAPES, TARGET_US = NoProjForm.shapes, NoProjForm.target_us  # bench/profile_kernel.py reads these


# ---- measurement ----

SPIN_US = 50  # GPU spin before each timed window: covers the host's queuing of the window's first replay


def spin_cycles(us, clock_khz=None):
    """GPU clock cycles that ``torch.cuda._sleep`` spins for ``us`` µs (100_000 when the clock is unknown)."""
    return int(us * clock_khz / 1e3) if clock_khz else 100_000


def replays_per_window(once_us, window_us=200.0, most=1000):
    """Back-to-back replays in one timed window: enough that the window holds >= ``window_us`` of GPU work."""
    return max(1, min(most, math.ceil(window_us / max(once_us, 1e-3))))


def graph_time_us(fn, input_sets, min_total_s=0.15, max_windows=200, window_us=200.0):
    """Median GPU µs of one call of ``fn``.

    A CUDA graph holds one call per input set. Each timed window is a GPU spin, the start event, R back-to-back
    replays and the end event; the spin keeps the GPU busy while the host queues the replays, so the window times
    GPU work only, not the host's submission latency. R makes a window hold >= ``window_us`` of work; the spin
    also covers the host's time to queue all R replays (measured). Per call = window / (R * len(input_sets));
    the median over windows is returned.
    """
    for inputs in input_sets:  # warm-up: compiles, loads, autotunes outside the graph
        fn(**inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with GraphWeights().capture(), torch.cuda.graph(graph):  # the plan's folded weights kept, not folded per replay
        for inputs in input_sets:
            fn(**inputs)
    graph.replay()
    torch.cuda.synchronize()
    clock_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", None)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def window(replays, spin_us):
        torch.cuda._sleep(spin_cycles(spin_us, clock_khz))
        t0 = time.perf_counter()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        host_us = (time.perf_counter() - t0) * 1e6
        end.synchronize()
        return start.elapsed_time(end) * 1e3, host_us

    # calibration: a long spin hides the host, so this reads one replay's GPU time and the host's cost to queue it
    probe = 8
    gpu_us, host_us = window(probe, 2000)
    once_us, host_per_replay_us = gpu_us / probe, host_us / probe
    replays = replays_per_window(once_us, window_us)
    spin_us = SPIN_US + replays * host_per_replay_us  # the host has queued the whole window before the GPU gets to it
    windows = int(max(10, min(max_windows, min_total_s * 1e6 / (spin_us + replays * once_us))))
    per_call = [window(replays, spin_us)[0] / (replays * len(input_sets)) for _ in range(windows)]
    del graph
    return statistics.median(per_call)


def copy_bandwidth_gbs(nbytes=2 << 30):
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del a, b
    return 2 * nbytes / (statistics.median(times[2:]) * 1e-3) / 1e9  # bytes read + written


def matmul_tflops(n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    e.synchronize()
    return 2 * n**3 * 10 / (s.elapsed_time(e) * 1e-3) / 1e12


def host_overhead_us(form, dtype, calls=2000):
    """Wall-clock µs per eager-mode call on a small shape (host bound: the GPU work is a few µs)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    t = form.make_inputs((1, 16, 512, 8, 77), dtype, gen)
    B, Lq, D = t["x"].shape

    def direct():
        return codegen.run_kernel(t["x"], t["k"], t["v"], t["gamma"], t["beta"], None, "layer", 1e-5, None, None,
                                  False)

    out = {}
    for name, fn in (("fusednorm_call", lambda: form.fused(**t)), ("codegen_run_kernel", direct),
                     ("eager_block", lambda: form.eager(**t))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out


def input_sets_for(form, shape, dtype, gen, l2_bytes):
    """Enough input sets that one graph replay streams more than ~3x L2 (so repeats do not time the cache)."""
    per_set = form.bytes_moved(shape, dtype)
    n = max(1, min(8, math.ceil(3 * l2_bytes / per_set)))
    return [form.make_inputs(shape, dtype, gen) for _ in range(n)]


def rel_diff(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", choices=sorted(FORMS), default="noproj")
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--shapes", default=None, help="comma-separated names from the form's table (default: all); "
                    + "; ".join(f"{n}: {','.join(f.shapes)}" for n, f in FORMS.items()))
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (saves its compile time)")
    ap.add_argument("--roles", action="store_true", help="also time each tile role of the fused kernel")
    ap.add_argument("--matmul-tflops", type=float, default=None, help="use this bf16 rate instead of measuring")
    args = ap.parse_args(argv)

    form, dtype = FORMS[args.form](), DTYPES[args.dtype]
    names = args.shapes.split(",") if args.shapes else list(form.shapes)
    unknown = [n for n in names if n not in form.shapes]
    if unknown:
        ap.error(f"form {form.name} has no shape {', '.join(unknown)}; it has {', '.join(form.shapes)}")
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth_gbs()
    tflops = args.matmul_tflops or matmul_tflops()
    print(f"device {props.name}, {props.multi_processor_count} SMs; copy {bw:.0f} GB/s; bf16 matmul "
          f"{tflops:.0f} TFLOP/s", flush=True)
    inductor = None if args.no_inductor else torch.compile(form.eager, dynamic=False)

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in names:
        shape = form.shapes[name]
        sets = input_sets_for(form, shape, dtype, gen, l2_bytes)
        nbytes, flops = form.bytes_moved(shape, dtype), form.flops(shape)
        floor_us = max(nbytes / (bw * 1e9), flops / (tflops * 1e12)) * 1e6
        check = rel_diff(form.fused(**sets[0]), form.eager(**sets[0]))
        row = dict(name=name, shape=dict(zip("B Lq D H Lk".split(), shape)), bytes=nbytes, flops=flops,
                   floor_us=floor_us, target_us=form.target_us.get(name), fused_vs_eager_rel_diff=check,
                   kernel=launch.last_launched if form.expects_kernel(shape) else None)  # the check's: its tile
        row["eager_us"] = graph_time_us(form.eager, sets)
        row["inductor_us"] = graph_time_us(inductor, sets) if inductor else None
        before = launch.launch_count
        row["fused_us"] = graph_time_us(form.fused, sets)
        row["fused_kernel_ran"] = launch.launch_count > before
        if form.expects_kernel(shape):
            assert row["fused_kernel_ran"], "the fused kernel did not run"
        if args.roles and row["fused_kernel_ran"]:
            for role in TILE_ROLES:
                select.force_role = role
                try:
                    row[f"fused_{role}_us"] = graph_time_us(form.fused, sets[:1], min_total_s=0.05)
                finally:
                    select.force_role = None
        row["fused_gbps"] = nbytes / (row["fused_us"] * 1e-6) / 1e9
        row["fused_tflops"] = flops / (row["fused_us"] * 1e-6) / 1e12
        row["pct_of_floor"] = 100 * floor_us / row["fused_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()

    host = host_overhead_us(form, dtype) if form.name == "noproj" else None  # the launch path of noproj
    result = dict(date=datetime.date.today().isoformat(), device=props.name, sms=props.multi_processor_count,
                  torch=torch.__version__, form=args.form, dtype=args.dtype, copy_gbs=bw, matmul_tflops=tflops,
                  shapes=rows, host_overhead_us=host)
    (args.out / f"bench_{args.form}.json").write_text(json.dumps(result, indent=1))
    _plot(rows, args.out / f"bench_{args.form}.png", f"{props.name}, {args.dtype}, form {args.form}")

    if host:
        print("\nhost overhead per eager call (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    print("\n| shape (B, Lq, D, H, Lk) | eager µs | Inductor µs | fusednorm µs | floor µs | target µs | GB/s | "
          "% of floor | generated kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["shape"]
        ind = f"{r['inductor_us']:.1f}" if r["inductor_us"] else "-"
        print(f"| {r['name']} ({s['B']}, {s['Lq']}, {s['D']}, {s['H']}, {s['Lk']}) | {r['eager_us']:.1f} | {ind} | "
              f"{r['fused_us']:.1f} | {r['floor_us']:.1f} | {r['target_us']} | {r['fused_gbps']:.0f} | "
              f"{r['pct_of_floor']:.0f} | {'yes' if r['fused_kernel_ran'] else 'no'} |")
    return 0


def _plot(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    names = [r["name"] for r in rows]
    series = [("eager", "eager_us"), ("Inductor", "inductor_us"), ("fusednorm", "fused_us"), ("floor", "floor_us")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.2
    for i, (label, key) in enumerate(series):
        vals = [r[key] or 0 for r in rows]
        ax.bar([j + (i - 1.5) * width for j in range(len(rows))], vals, width, label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), names, rotation=20)
    ax.set_ylabel("GPU µs per call (median of timed CUDA-graph replay windows)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
