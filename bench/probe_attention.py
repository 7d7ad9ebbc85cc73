"""Time FlashAttention-3's warp-specialised main loop on fusednorm's long-key shapes (one GPU, one run).

    PYTHONPATH=. python bench/probe_attention.py [--shapes prefill,lk2048,t5] [--variants ...] [--fused]
    PYTHONPATH=. python bench/probe_attention.py --compile-only      # no GPU: registers, spills, ptxas warnings
    ncu --metrics ... python bench/probe_attention.py --once --shapes prefill --variants serial,overlap_pingpong

Why: on Whisper prefill, the seed with Lk 2048 and T5 the generated kernel reaches ~275-320 TFLOP/s, and the
overlap it lacks (each warpgroup's softmax behind its own matrix products) lost when built into it, for want of
registers (docs/PERF.md, thirty-second run). FlashAttention-3 gets them with a producer warpgroup that gives its
registers to the consumers (setmaxnreg). The probe (bench/probe_attention.cu) is that structure for plain attention
(d = 64, bf16), in variants that switch on its pieces one by one, and with ``--fused`` as fusednorm's whole block
(LayerNorm in the prologue, the residual in the epilogue), timed beside torch's SDPA (cuDNN and FlashAttention-2
backends), eager PyTorch's block and fusednorm's on the same shapes, so that the gain the structure would bring is
measured before it is built into the generated kernel. Each variant's output is checked against a float64 reference
first (error at most 2x eager PyTorch's in bf16, output poisoned before the launch).
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from fusednorm.codegen.nvrtc import compile_to_cubin  # noqa: E402
from fusednorm.codegen.render import wgmma_helpers  # noqa: E402

D = 64
SHAPES = {  # (B, H, Lq, Lk): the block benchmark's long-key shapes
    "prefill": (16, 20, 448, 1500),
    "lk2048": (32, 16, 2048, 2048),
    "t5": (32, 16, 128, 512),
}
# name: (OVERLAP, PINGPONG, STAGES, BLOCK_N, CONSUMERS)
VARIANTS = {
    "serial": (0, 0, 2, 128, 2),
    "serial_n64": (0, 0, 2, 64, 2),  # fusednorm's long tile's stage width
    "serial_n64_s4": (0, 0, 4, 64, 2),
    "serial_pingpong": (0, 1, 2, 128, 2),
    "overlap": (1, 0, 3, 128, 2),
    "overlap_pingpong": (1, 1, 3, 128, 2),
    "overlap_pingpong_s4": (1, 1, 4, 128, 2),
    "overlap_pingpong_n112": (1, 1, 3, 112, 2),
    "overlap_pingpong_n192_s2": (1, 1, 2, 192, 2),
    # FlashAttention-3's d = 64 shape: 192 rows, three consumers at 160 registers (128 keys per stage spill there)
    "wg3_serial": (0, 0, 2, 96, 3),
    "wg3_overlap": (1, 0, 3, 96, 3),
    "wg3_overlap_pingpong": (1, 1, 3, 96, 3),
}
MODE_LABELS = {0: "", 1: " (block, statistics inline)", 2: " (block, statistics ahead)"}
Q_SLOTS = 2  # probe_attention.cu's ring of Q (FUSED: x slice) slots
# setmaxnreg (producer, consumer) per (consumers, statistics summed ahead): 128 * P + 128 * CONSUMERS * C <= 65536.
# Three consumers need 160 with the norm inline; the producer's warps summing the statistics need 40 (else spills).
REGS = {(2, False): (40, 232), (2, True): (40, 232), (3, False): (32, 160), (3, True): (40, 152)}


def source(overlap: int, pingpong: int, stages: int, block_n: int, consumers: int, fused: int = 0) -> str:
    """fused: 0 plain attention, 1 the whole block with each consumer warp summing its rows' statistics at an item's
    start, 2 the whole block with the producer warpgroup's idle warps summing them an item ahead (see the .cu)."""
    prelude = (ROOT / "fusednorm/codegen/templates/prelude.cu").read_text()
    probe = (ROOT / "bench/probe_attention.cu").read_text()
    spec = SimpleNamespace(dtype="bf16", head_dim=D, rowsum_in_pv=True, tile=SimpleNamespace(block_n=block_n,
                                                                                             wgmma=True))
    head = (f"constexpr bool ELEM_IS_BF16 = true, FUSED = {str(fused > 0).lower()}, "
            f"STATS_AHEAD = {str(fused == 2).lower()};\n"
            f"constexpr int OVERLAP = {overlap}, PINGPONG = {pingpong}, "
            f"STAGES = {stages}, BLOCK_N = {block_n}, CONSUMERS = {consumers};\nconstexpr int PRODUCER_REGS = "
            f"{REGS[consumers, fused == 2][0]}, CONSUMER_REGS = {REGS[consumers, fused == 2][1]};\n")
    return head + prelude + "\n" + wgmma_helpers(spec) + "\n" + probe


def smem_bytes(stages: int, block_n: int, consumers: int) -> int:
    """probe_attention.cu's SMEM_BYTES: Q slots, K/V stages, the block of ones, the row statistics, the barriers."""
    tile, block_m = block_n * 128, 64 * consumers
    return Q_SLOTS * block_m * 128 + 2 * stages * tile + tile + 2 * block_m * 2 * 4 + 8 * (2 * stages + 2 * Q_SLOTS + 4)


def compile_variant(name: str, fused: int = 0):
    cubin, usage, log_text = compile_to_cubin(source(*VARIANTS[name], fused=fused), "probe_attention", 90)
    return cubin, usage, log_text


def heads_per_item(batch: int, row_blocks: int, heads: int, sms: int) -> int:
    """FUSED: the most heads per item (fewest statistics passes) that still leave two items per SM."""
    for g in range(heads, 0, -1):
        if heads % g == 0 and batch * row_blocks * (heads // g) >= 2 * sms:
            return g
    return 1


class Probe:
    def __init__(self, name: str, fused: int = 0):
        import torch
        from cuda.bindings import driver as cu

        self.cu, self.name, self.fused = cu, name, fused
        _, _, self.stages, self.block_n, self.consumers = VARIANTS[name]
        self.block_m = 64 * self.consumers
        cubin, self.usage, self.log = compile_variant(name, fused)
        torch.cuda.current_stream()  # torch's context current before the driver calls
        err, self.module = cu.cuModuleLoadData(cubin)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        err, self.function = cu.cuModuleGetFunction(self.module, b"probe_attention")
        assert err == cu.CUresult.CUDA_SUCCESS, err
        self.smem = smem_bytes(self.stages, self.block_n, self.consumers)
        (err,) = cu.cuFuncSetAttribute(self.function,
                                       cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       self.smem)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        self.args = ctypes.create_string_buffer(64)
        self.maps = ctypes.create_string_buffer(3 * 128 + 64)  # three tensor maps, 64-byte aligned
        self.maps_at = (ctypes.addressof(self.maps) + 63) // 64 * 64
        self.argv = (ctypes.c_void_p * 2)(ctypes.addressof(self.args), self.maps_at)

    def bind(self, q, k, v, o, x=None, gamma=None, beta=None, eps=1e-5):
        """Encode the maps and arguments of one input set (kept: graph replays reuse them). Plain attention: q, k, v
        and o of [B, H, L, 64]. FUSED: x and o (that is, y) of [B, Lq, H * 64] and q None."""
        import torch

        from fusednorm.codegen.tensormap import tile_map

        B, H, Lk = k.shape[0], k.shape[1], k.shape[2]
        Lq = x.shape[1] if x is not None else q.shape[2]
        kv = b"".join(tile_map(t.data_ptr(), (D, Lk, H, B), (1, D, Lk * D, H * Lk * D), (D, self.block_n, 1, 1))
                      for t in (k, v))
        if x is None:
            q_map = tile_map(q.data_ptr(), (D, Lq, H, B), (1, D, Lq * D, H * Lq * D), (D, self.block_m, 1, 1))
        else:
            q_map = tile_map(x.data_ptr(), (H * D, Lq, B), (1, H * D, Lq * H * D), (D, self.block_m, 1))
        ctypes.memmove(self.maps_at, q_map + kv, 3 * 128)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        row_blocks = math.ceil(Lq / self.block_m)
        g = heads_per_item(B, row_blocks, H, sms) if x is not None else 1
        items = B * row_blocks * (H // g)
        scale_log2 = (1.0 / math.sqrt(D)) * 1.4426950408889634
        ptrs = [o.data_ptr()] + [t.data_ptr() if t is not None else 0 for t in (x, gamma, beta)]
        struct.pack_into("<4Q6i2f", self.args, 0, *ptrs, H, Lq, Lk, row_blocks, items, g, scale_log2, eps)
        return min(items, sms)

    def launch(self, grid):
        import torch

        cu = self.cu
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        (err,) = cu.cuLaunchKernel(self.function, grid, 1, 1, 128 * (self.consumers + 1), 1, 1, self.smem, stream,
                                   ctypes.addressof(self.argv), 0)
        assert err == cu.CUresult.CUDA_SUCCESS, err


def flops(shape) -> float:
    B, H, Lq, Lk = shape
    return 4.0 * B * H * Lq * Lk * D


def block_inputs(shape, gen):
    """FUSED's inputs: x of [B, Lq, H * 64], LayerNorm's gamma and beta, K and V of [B, H, Lk, 64] (bf16)."""
    import torch

    B, H, Lq, Lk = shape
    x = torch.randn(B, Lq, H * D, device="cuda", generator=gen).to(torch.bfloat16)
    gamma, beta = (torch.randn(H * D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, H, Lk, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    return x, gamma, beta, k, v


def eager_block(x, gamma, beta, k, v):
    """y = x + SDPA(LayerNorm(x) split into heads, k, v), in x's dtype (as eager PyTorch runs the block)."""
    import torch.nn.functional as F

    B, Lq, model_dim = x.shape
    h = F.layer_norm(x, (model_dim,), gamma, beta, 1e-5)
    o = F.scaled_dot_product_attention(h.view(B, Lq, k.shape[1], D).transpose(1, 2), k, v)
    return x + o.transpose(1, 2).reshape(B, Lq, model_dim)


def check(probe: Probe, gen) -> str:
    """Max abs error against a float64 reference on fresh inputs (lengths that are no multiple of the tiles), next to
    eager PyTorch's in bf16 (SDPA's, for plain attention); raises if the probe's is more than twice that."""
    import torch
    import torch.nn.functional as F

    shape = (2, 3, 200, 333)
    if probe.fused:
        x, gamma, beta, k, v = block_inputs(shape, gen)
        y = torch.full_like(x, float("nan"))
        probe.launch(probe.bind(None, k, v, y, x, gamma, beta))
        ref = eager_block(*(t.double() for t in (x, gamma, beta, k, v)))
        ours, eager = y, eager_block(x, gamma, beta, k, v)
    else:
        q, k, v = (torch.randn(shape[0], shape[1], n, D, device="cuda", generator=gen).to(torch.bfloat16)
                   for n in (shape[2], shape[3], shape[3]))
        o = torch.full_like(q, float("nan"))
        probe.launch(probe.bind(q, k, v, o))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        ours, eager = o, F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    ours, eager = ((t.double() - ref).abs().max().item() for t in (ours, eager))
    if not ours <= 2 * eager + 1e-6:
        raise AssertionError(f"{probe.name}: max error {ours:.3e} against eager's {eager:.3e}")
    return f"max error {ours:.2e} (eager bf16 {eager:.2e})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--once", action="store_true", help="one launch per variant and shape, nothing timed (for ncu)")
    ap.add_argument("--fused", action="store_true", help="the probes as the whole block: y = x + attention(norm(x)), "
                    "with the row statistics summed inline and ahead")
    args = ap.parse_args()
    names = args.variants.split(",")
    modes = (1, 2) if args.fused else (0,)
    if args.compile_only:
        for name, mode in itertools.product(names, modes):
            _, usage, log_text = compile_variant(name, mode)
            warn = [line for line in log_text.splitlines() if "arning" in line or "C75" in line]
            print(f"{name + MODE_LABELS[mode]:60s} {usage.registers} registers, {usage.spill_stores} spill bytes"
                  + (f"; {warn}" if warn else ""))
        return

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fusednorm
    from bench_block import graph_time_us

    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.once:
        for shape_name in args.shapes.split(","):
            B, H, Lq, Lk = SHAPES[shape_name]
            q, k, v = (torch.randn(B, H, n, D, device="cuda", generator=gen).to(torch.bfloat16) for n in (Lq, Lk, Lk))
            for name in names:
                probe = Probe(name)
                probe.launch(probe.bind(q, k, v, torch.empty_like(q)))
        torch.cuda.synchronize()
        return
    probes = {}
    for name, mode in itertools.product(names, modes):
        probe = probes[name + MODE_LABELS[mode]] = Probe(name, mode)
        print(f"{name + MODE_LABELS[mode]}: {probe.usage.registers} registers, {check(probe, gen)}", flush=True)
    print("\n| shape (B, H, Lq, Lk) | implementation | µs | TFLOP/s |\n|---|---|---|---|")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        x, gamma, beta, k, v = block_inputs(shape, gen)
        B, Lq = x.shape[:2]
        q = F.layer_norm(x, (x.shape[2],), gamma, beta, 1e-5).view(B, Lq, shape[1], D).transpose(1, 2).contiguous()
        out = torch.empty_like(x if args.fused else q)
        rows = []
        for backend, label in ((SDPBackend.CUDNN_ATTENTION, "SDPA cuDNN"), (SDPBackend.FLASH_ATTENTION,
                                                                             "SDPA flash")):
            try:
                with sdpa_kernel([backend]):
                    rows.append((label, graph_time_us(lambda: F.scaled_dot_product_attention(q, k, v), [{}])))
            except Exception as e:  # a backend this build or shape lacks
                print(f"{label}: {str(e).splitlines()[0]}")
        rows.append(("eager block (LayerNorm, SDPA, add)", graph_time_us(lambda: eager_block(x, gamma, beta, k, v),
                                                                          [{}])))
        # fusednorm's whole block (norm + attention + residual), K/V as [B, H, Lk, d]
        rows.append(("fusednorm block", graph_time_us(lambda: fusednorm.fused_pre_norm_cross_attn(x, k, v, gamma,
                                                                                                  beta), [{}])))
        for label, probe in probes.items():
            grid = probe.bind(None, k, v, out, x, gamma, beta) if args.fused else probe.bind(q, k, v, out)
            rows.append((f"probe {label}", graph_time_us(lambda: probe.launch(grid), [{}])))
        for label, us in rows:
            print(f"| {shape_name} {shape} | {label} | {us:.1f} | {flops(shape) / us / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
