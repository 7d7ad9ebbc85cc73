"""Whether a matched block takes the fused op (the plan, or for a projection-free block the generated kernel) or stays
with the compiler.

Options: ``plan="never"`` (the default without option cudagraphs: blocks with projections stay with the compiler),
``"measure"`` (the default with it), ``"always"`` (tests, benchmarks). With ``plan="measure"``, for each new
(device, dtype, shapes, variant) the plan is timed against the compiler (Inductor) on the same block with random
inputs of those shapes (the block as the model wrote it, its own nodes, against what the rewrite puts in their
place, both compiled by Inductor: passes/block_graph.py; the op against the canonical block of ``unfused_block``
where the nodes cannot be copied out), and taken only when it is faster on the GPU *and* costs clearly less host
time per call than the compiler's block (``HOST_MARGIN``): inside a compiled model the compiler's kernels of the
block are launched from one generated wrapper, while the plan is an extern op call whose Python and cuBLAS
launches cost host time of their own (168 µs per call for T5-base's block on the H200's host, 337 on an H100's).
A model that is host-bound pays that in full and gains nothing from the GPU time saved: T5-base at batch 32 took
7.36 ms per call with its blocks on the plan against Inductor's 6.21, while its GPU time fell from 5.15 to 4.74 ms
(docs/PERF.md §3); an SD-1.5 UNet at batch 2 once lost 23 % the same way. The plan's host time must also stay
below its own GPU time, or the host falls behind the GPU on every such block (Whisper-base's decoder: 157 µs of host
for 98 µs of GPU, at 0.71 of the compiler's host time, made the model 31 % slower per call). GPU times come from
CUDA-graph replay, so neither side's host cost leaks into them. With option ``cudagraphs`` the model replays CUDA
graphs, the plan's host cost is paid once at capture, and GPU time alone decides (one measurement serves both).

``kernel="auto"`` (the default for projection-free blocks) takes the generated kernel without measuring where the
block is memory-bound and big enough to fill the GPU, and measures where it is not. Memory-bound means at most
``ridge_flop_per_byte(arch)`` FLOPs (QK^T and P V) per byte the kernel must move (x read, y written, k, v, the
mask): there the kernel wins by what it does not move (the compiler's block writes and reads the normed x and the
attention output, ~5 more passes over x), and its math is not the bottleneck. Above it the block's time is the
attention's math, where the compiler's SDPA kernel can be faster than the generated one (2048 keys on the H200:
docs/PERF.md §1), so the two are timed. So is a block with fewer (batch, head, 64-row block) units than SMs (a
decode step at batch 1: Whisper's 20 units on 132 SMs), whose time is latency rather than bytes (docs/PERF.md §1:
the kernel 12.8 µs, Inductor 11.2; with its keys split between CTAs since, 11.1 against 11.8 on an H100).
``"always"`` takes the kernel everywhere; ``"measure"`` times every shape. GPU time alone decides: the kernel's
host cost per call (~20-35 µs) is about that of the few launches the compiler's wrapper makes for the same block.

The measurement runs in a worker thread: the backend is called inside Dynamo's compile, whose tracing context
and fake mode are thread-local, so the nested Inductor compile of the reference block sees neither.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

POLICIES = ("measure", "always", "never")
KERNEL_POLICIES = ("auto", "always", "measure")
RIDGE_FLOP_PER_BYTE = 192.0  # sm_90: the H200's bf16 matmul rate over its copy bandwidth (~800 TFLOP/s / 4.2 TB/s)
# Archs fusednorm has not been measured on get a ridge at or below what their parts reach, so that "auto" times a
# block rather than assumes: sm_80 an A100-80GB's 312 TFLOP/s over 2.0 TB/s at the H200's achieved fractions (~140);
# any other arch 64 (GeForce sm_86/sm_89 parts reach only ~70-165).
RIDGES = {90: RIDGE_FLOP_PER_BYTE, 80: 140.0}
UNMEASURED_RIDGE = 64.0
MARGIN = 0.97        # the plan must beat the compiler by 3 %: timing noise never flips a block to a slower path
# Without CUDA graphs the plan must also take at most this share of the compiler's host time per call. Its host path
# is Python, which a model pays more for than a loop over one block does: T5-base's block timed at 0.91 of the
# compiler's host time (212.6 against 233.2 µs), and on the plan the host-bound model ran 6.7 % slower per call
# (7.28 against 6.82 ms; H100, 2026-12-06, docs/PERF.md §3), about 38 µs more per block than the loop said.
HOST_MARGIN = 0.75
# and at most its own GPU time: Whisper-base's block (H100, 2026-12-07, docs/PERF.md §3) timed 157.0 µs of host for
# 98.2 of GPU, at 0.71 of the compiler's host time, and on the plan the model ran 3.69 ms per call against 2.81.
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Choice:
    fused: bool
    reason: str       # in words, for the report: what was measured or why nothing was


class Timing(NamedTuple):
    """One block shape measured, µs per call: GPU time by CUDA-graph replay, host time enqueueing calls."""
    fused_us: float
    fused_host_us: float
    compiler_us: float
    compiler_host_us: float
    note: str = ""    # for the report, where a side is a stand-in (the canonical block, the op alone)


_timings: dict[tuple, Timing | str] = {}   # per block shape: its Timing, or why it could not be measured
_lock = threading.Lock()


def unfused_block(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm, eps, scale):
    """The block as eager models compute it, in x's dtype (what the compiler would otherwise get)."""
    D = x.shape[-1]
    if norm == "layer":
        h = F.layer_norm(x, (D,), gamma, beta, eps)
    else:
        h = F.rms_norm(x, (D,), gamma, eps)
    B, Lq, _ = x.shape
    H, d = k.shape[1], k.shape[3]
    q = F.linear(h, wq, bq) if wq is not None else h
    q = q.view(B, Lq, H, d).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = a.transpose(1, 2).reshape(B, Lq, H * d)
    return x + (F.linear(o, wo, bo) if wo is not None else o)


def _fused_op(args: dict) -> str:
    """What fuses the block: the generated kernel (no projections) or the plan."""
    return "kernel" if args.get("wq") is None and args.get("wo") is None else "plan"


def decide(args: dict, norm: str, policy: str, host_time_counts: bool = True, block=None) -> Choice:
    """The fused op or the compiler for one matched block; ``args`` are the op's arguments as fakes or metadata,
    ``policy`` the plan option for a block with projections, the kernel option for one without.
    ``host_time_counts=False`` when the compiled graph is replayed as CUDA graphs (option cudagraphs): the plan's
    host cost is then paid once, at capture, and GPU time alone decides. ``block``: a function giving the matched
    nodes as a BlockGraph (or why they cannot be one), called only when the block is timed."""
    what = _fused_op(args)
    allowed = KERNEL_POLICIES if what == "kernel" else POLICIES
    if policy not in allowed:
        raise ValueError(f"fusednorm: option {what}={policy!r}; expected one of {allowed}")
    if policy == "always":
        return Choice(True, f"the {what} (option {what}='always')")
    if policy == "never":
        return Choice(False, "left to the compiler (option plan='never', the default without option cudagraphs)")
    tensors = {n: args[n] for n in ("x", "k", "v", "gamma", "beta", "wq", "bq", "wo", "bo", "mask")}
    dynamic = any(t is not None and not all(isinstance(s, int) for s in t.shape) for t in tensors.values())
    if policy == "auto":
        intensity = None if dynamic else flop_per_byte(tensors)
        if intensity is None:
            return Choice(True, "the kernel (option kernel='auto', the default: dynamic shapes, not measured)")
        ridge = ridge_flop_per_byte(_arch(tensors["x"]))
        units, sms = work_units(tensors), _sm_count(tensors["x"])
        if intensity <= ridge and units >= sms:
            return Choice(True, f"the kernel (option kernel='auto', the default: memory-bound, {intensity:.0f} "
                                f"FLOP/byte <= {ridge:.0f})")
        why = (f"the block is not memory-bound ({intensity:.0f} FLOP/byte > {ridge:.0f})" if intensity > ridge
               else f"the block leaves SMs idle ({units} (batch, head, 64-row block) units for {sms} SMs)")
    if dynamic:
        return Choice(False, f"left to the compiler: dynamic shapes (the {what} is chosen by measuring a fixed shape)")
    try:
        graph = block() if block is not None else None
    except Exception as e:  # noqa: BLE001 - the canonical block stands in, and the reason says why
        graph = f"copying its nodes raised {type(e).__name__}: {e}"
    key = (_key(tensors, norm, args["scale"]), getattr(graph, "signature", None))
    with _lock:
        timed = _timings.get(key)
        if timed is None:
            timed = _timings[key] = _measure(tensors, norm, float(args["eps"]), args["scale"], graph)
    if isinstance(timed, str):
        hit = Choice(False, f"left to the compiler: the {what} could not be measured ({timed[:200]})")
    else:
        hit = _verdict(timed, what=what, host_time_counts=host_time_counts)
    if policy == "auto":
        return Choice(hit.fused, f"{hit.reason}; timed as option kernel='auto' does where {why}")
    return hit


def ridge_flop_per_byte(arch: int) -> float:
    """FLOPs per byte above which a block on this arch (major * 10 + minor) is timed rather than given the kernel."""
    return RIDGES.get(arch, UNMEASURED_RIDGE)


def work_units(tensors: dict) -> int:
    """The block's independent pieces of work, (batch, head, 64-row block): fewer than the SMs (a decode step at a
    small batch) and the kernel's time is latency, not bytes, and the compiler's kernels may be as fast."""
    B, Lq, _ = tensors["x"].shape
    return B * tensors["k"].shape[1] * -(-Lq // 64)


def _sm_count(x) -> int:
    return torch.cuda.get_device_properties(x.device).multi_processor_count


def _arch(x) -> int:
    major, minor = torch.cuda.get_device_capability(x.device)
    return major * 10 + minor


def flop_per_byte(tensors: dict) -> float:
    """The projection-free block's arithmetic intensity as the generated kernel runs it: the FLOPs of QK^T and P V
    over the bytes it reads and writes once (x, y, k, v, the mask; the norm's parameters are negligible)."""
    x, k, v, mask = tensors["x"], tensors["k"], tensors["v"], tensors["mask"]
    B, Lq, _ = x.shape
    _, H, Lk, d = k.shape
    flops = 4 * B * H * Lq * Lk * d
    nbytes = (2 * math.prod(x.shape) + math.prod(k.shape) + math.prod(v.shape)) * x.dtype.itemsize
    if mask is not None:
        nbytes += math.prod(mask.shape) * mask.dtype.itemsize
    return flops / nbytes


def _key(tensors, norm, scale):
    def sig(t):
        return None if t is None else (tuple(t.shape), str(t.dtype))

    x = tensors["x"]
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (torch.cuda.get_device_name(device), norm, scale, tuple(sig(t) for t in tensors.values()))


def _measure(tensors, norm, eps, scale, graph=None) -> Timing | str:
    """The block's Timing, or why it could not be measured."""
    result: dict = {}

    def work():
        try:
            result["times"] = _time_both(tensors, norm, eps, scale, graph)
        except Exception as e:  # noqa: BLE001 - a failed measurement leaves the block to the compiler
            result["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=work, name="fusednorm-plan-measure", daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    return result.get("times") or result.get("error", f"no result within {TIMEOUT_S:.0f} s")


def _verdict(t: Timing, what: str = "plan", host_time_counts: bool = True) -> Choice:
    """The fused side must beat the compiler by GPU time; the plan, unless replayed as CUDA graphs, must also cost
    clearly less host time per call than the compiler's block (HOST_MARGIN) and no more than its own GPU time (see
    the module's docstring)."""
    measured = (f"measured {what} {t.fused_us:.1f} µs GPU, {t.fused_host_us:.1f} µs host per call vs compiler "
                f"{t.compiler_us:.1f} µs GPU, {t.compiler_host_us:.1f} µs host{t.note}")
    if what == "plan" and not host_time_counts:
        measured += "; host time not counted: replayed as CUDA graphs (option cudagraphs)"
    faster = t.fused_us < MARGIN * t.compiler_us
    host_counts = what == "plan" and host_time_counts
    if not faster:
        why = "not faster"
    elif host_counts and t.fused_host_us > HOST_MARGIN * t.compiler_host_us:
        why = "more host time per call"
    elif host_counts and t.fused_host_us > t.fused_us:
        why = "host time per call above its GPU time"
    else:
        return Choice(True, f"the {what} ({measured})")
    return Choice(False, f"left to the compiler: {why} ({measured})")


def _time_both(tensors, norm, eps, scale, graph=None) -> Timing:
    """The block measured on random inputs of these shapes. The fused side is what the rewrite puts in the block's
    place (the graph's replacement) where there is a graph of the block, else the op alone."""
    x = tensors["x"]
    device = torch.device("cuda", x.device.index if x.device.index is not None else torch.cuda.current_device())
    made: dict = {}

    def real() -> dict:  # random op arguments, made only where the op alone or the canonical block is timed
        if not made:
            made.update({n: _random_like(n, t, device) for n, t in tensors.items()})
        return made

    with torch.cuda.device(device), torch.no_grad():
        compiled, inputs, note = compiler_block(real, norm, eps, scale, graph, device)
        plan = None
        replacement = None if note else getattr(graph, "replacement", None)
        if isinstance(replacement, str):
            note = f" (against the op alone: {replacement})"
        elif replacement is not None:  # what the rewrite puts in the block's place, compiled as the model's graph is
            try:
                fused = _inductor(replacement, inputs)
                plan = lambda: fused(*inputs)  # noqa: E731
            except Exception as e:  # noqa: BLE001 - the op alone is still a fair stand-in
                note = f" (against the op alone: {type(e).__name__}: {str(e)[:120]})"
        if plan is None:
            op_args = [real()[n] for n in tensors] + [norm, eps, scale]
            plan = lambda: torch.ops.fusednorm.pre_norm_cross_attn(*op_args)  # noqa: E731 - as a graph calls it
        from .weights import GraphWeights

        with GraphWeights().capture():  # the folded weights read from their kept buffers, as in a model's graphs
            plan_us = _graph_us(plan)
        plan_host_us = _host_us(plan)
        compiler_us = _graph_us(lambda: compiled(*inputs))
        compiler_host_us = _host_us(lambda: compiled(*inputs))
    return Timing(plan_us, plan_host_us, compiler_us, compiler_host_us, note)


def compiler_block(real, norm, eps, scale, graph, device) -> tuple:
    """(Inductor's compiled block, its inputs, what it is in words for the report, or ""): the block's own nodes
    (``graph``, a BlockGraph) on fresh random inputs of their layouts, else, with the reason, the canonical block
    (``unfused_block``) on ``real()``, the op's arguments (called only then)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if graph is not None and not isinstance(graph, str):
        try:
            inputs = [_random_strided(role, tuple(t.shape), tuple(t.stride()), t.dtype, device)
                      .requires_grad_(t.requires_grad) for role, t in graph.inputs]  # as the model's (_inductor)
            return _inductor(graph.gm, inputs), inputs, ""
        except Exception as e:  # noqa: BLE001 - the canonical block is still a fair stand-in
            graph = f"{type(e).__name__}: {str(e)[:120]}"
    real = real()
    names = [n for n, t in real.items() if t is not None]

    def block(*ts):
        kw = dict(real, **dict(zip(names, ts)))
        return unfused_block(**kw, norm=norm, eps=eps, scale=scale)

    inputs = [real[n] for n in names]
    note = f" (on the canonical block: the model's nodes of it could not be timed, {graph})" if graph else ""
    return torch._inductor.compile(make_fx(block)(*inputs), inputs), inputs, note


def _inductor(gm: torch.fx.GraphModule, inputs: list):
    """``gm`` (a graph of Dynamo's level: torch functions, modules' calls) compiled by Inductor for ``inputs``,
    traced to aten as the model's graph is: with grad mode on, so that a linear on a weight that requires grad
    folds its batch dims into one mm (under no_grad a transposed input, nn.MultiheadAttention's, makes it a bmm
    against the weight expanded per row: 6x slower on an H100)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.enable_grad():
        traced = make_fx(torch.fx.Interpreter(gm).run)(*inputs)
    return torch._inductor.compile(traced, inputs)


def _random_like(name, t, device):
    """Fresh random values of t's shape and dtype (never zeros), contiguous: the op argument ``name``'s."""
    if t is None:
        return None
    shape = tuple(t.shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    r = _random_strided(name, shape, stride, t.dtype, device)
    if t.dtype == torch.bool:
        r[..., 0] = True  # no fully masked row: the compiler's SDPA would return NaN there
    return r


def _random_strided(role: str, shape: tuple, stride: tuple, dtype, device) -> torch.Tensor:
    """Fresh random values in a layout the model hands the block (a broadcast input keeps its zero strides), scaled
    like a trained layer's for the op argument ``role`` ("" for an input that is none: a matrix as a weight)."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    if dtype == torch.bool:
        return (torch.rand(span, device=device) > 0.2).as_strided(shape, stride)
    flat = torch.randn(span, device=device)
    if role in ("wq", "wo") or (not role and len(shape) == 2):
        flat /= math.sqrt(shape[-1])
    elif role == "gamma":
        flat = 1 + 0.1 * flat
    elif role in ("beta", "bq", "bo", "mask"):
        flat *= 0.1
    return flat.to(dtype).as_strided(shape, stride)


def _graph_us(fn, reps: int = 10, windows: int = 3) -> float:
    """GPU time per call: one call captured in a CUDA graph, replayed back to back (no host cost in it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = math.inf
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # queued ahead of the start event, so the host's replay calls overlap GPU work
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    del graph
    return best


def _host_us(fn, reps: int = 20, windows: int = 3) -> float:
    """Host time per call: wall clock of enqueueing calls back to back (the GPU keeps up or the queue absorbs it),
    the least of a few windows after two warm-up calls: a one-off stall (a first call's setup, the compiler's
    worker processes taking the CPU) is not the call's cost."""
    fn()
    fn()
    best = math.inf
    for _ in range(windows):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize()
    return best
