"""Time the decode tile's K/V stream alone, under several copy forms, stage counts and CTAs per SM (one GPU, one run).

    PYTHONPATH=. python bench/probe_copies.py [--shape 64,1500,20] [--forms 0,1,2,3]

Why: on Whisper decode the generated kernel reads K/V at 3.65 TB/s where eager's cuDNN kernel reads 4.06, and ncu
charges each of its 16-byte K/V copies 24 L2 sectors for 16 useful ones (docs/PERF.md §1, tenth run). The probe
(bench/probe_copies.cu) streams the same rows through shared memory with nothing computed, so the copy form and the
occupancy are measured apart from everything else the kernel does. Forms: see the .cu file's header. Prints GB/s
(K and V bytes read once) for each configuration, beside the device-to-device copy bandwidth of the same run.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from fusednorm.codegen.nvrtc import compile_to_cubin  # noqa: E402

THREADS, STAGE_BYTES, SMEM_PER_SM = 128, 16 * 1024, 228 * 1024
FORMS = {0: "cp.async, source size", 1: "cp.async, L2::128B", 2: "ld.global + st.shared", 3: "cp.async.bulk rows"}


def source(form: int, stages: int) -> str:
    prelude = (ROOT / "fusednorm/codegen/templates/prelude.cu").read_text()
    probe = (ROOT / "bench/probe_copies.cu").read_text()
    head = f"constexpr bool ELEM_IS_BF16 = true;\n#define COPY_FORM {form}\nconstexpr int STAGES = {stages};\n"
    return head + prelude + "\n" + probe


def smem_bytes(stages: int, ctas_per_sm: int) -> int:
    """Dynamic shared memory that leaves room for exactly ``ctas_per_sm`` CTAs (1 KB per CTA is the driver's)."""
    need = stages * STAGE_BYTES + 8 * stages
    pad = (SMEM_PER_SM // ctas_per_sm - 1024) // 128 * 128
    return max(need, pad)


class Probe:
    def __init__(self, form: int, stages: int):
        from cuda.bindings import driver as cu

        self.cu = cu
        cubin, self.usage, _ = compile_to_cubin(source(form, stages), "probe_copies", 90)
        torch.cuda.current_stream()  # torch's context current before the driver calls
        err, self.module = cu.cuModuleLoadData(cubin)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        err, self.function = cu.cuModuleGetFunction(self.module, b"probe_copies")
        assert err == cu.CUresult.CUDA_SUCCESS, err
        self.stages = stages

    def ctas_per_sm(self, smem: int) -> int:
        cu = self.cu
        (err,) = cu.cuFuncSetAttribute(self.function,
                                       cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, THREADS, smem)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        return n

    def launch(self, k, v, heads, kv_len, items, grid, smem, sink):
        cu = self.cu
        args = ((k.data_ptr(), v.data_ptr(), k.stride(1) * 2, k.stride(0) * 2, heads, kv_len, items, sink.data_ptr()),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                 ctypes.c_int, ctypes.c_void_p))
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        (err,) = cu.cuLaunchKernel(self.function, grid, 1, 1, THREADS, 1, 1, smem, stream, args, 0)
        assert err == cu.CUresult.CUDA_SUCCESS, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64,1500,20", help="B,Lk,H (head dim 64)")
    ap.add_argument("--forms", default="0,1,2,3")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--ctas", default="2,3,4")
    args = ap.parse_args()
    from bench_block import copy_bandwidth_gbs, graph_time_us

    B, Lk, H = (int(s) for s in args.shape.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B, Lk, H, 64, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(B, Lk, H, 64, device="cuda", generator=gen).to(torch.bfloat16)
    items, nbytes = B * H, 2 * k.numel() * 2
    sink = torch.empty(max(items, 8 * sms) * THREADS, dtype=torch.int32, device="cuda")
    print(f"K/V of (B, Lk, H, d) = ({B}, {Lk}, {H}, 64): {nbytes / 1e6:.1f} MB; device-to-device copy "
          f"{copy_bandwidth_gbs():.0f} GB/s")
    print("| copy form | stages | CTAs per SM | grid | µs | GB/s | registers |\n|---|---|---|---|---|---|---|")
    for form in (int(f) for f in args.forms.split(",")):
        for stages in ([2] if form == 2 else [int(s) for s in args.stages.split(",")]):  # form 2: one buffer
            probe = Probe(form, stages)
            for want in (int(c) for c in args.ctas.split(",")):
                smem = smem_bytes(stages, want)
                ctas = probe.ctas_per_sm(smem)
                for grid in sorted({min(items, sms * ctas), items}):
                    us = graph_time_us(lambda: probe.launch(k, v, H, Lk, items, grid, smem, sink), [{}])
                    shown_stages = "-" if form == 2 else stages
                    print(f"| {FORMS[form]} | {shown_stages} | {ctas} | {grid} | {us:.1f} | {nbytes / us / 1e3:.0f} "
                          f"| {probe.usage.registers} |", flush=True)


if __name__ == "__main__":
    main()
