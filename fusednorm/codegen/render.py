"""Spec -> CUDA source: the configuration constants, then the prelude and the kernel templates, verbatim."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .spec import KernelSpec

TEMPLATE_DIR = Path(__file__).parent / "templates"
# The source of every kernel, in this order (each part uses only what the parts above it define):
TEMPLATES = (
    "prelude.cu",              # 16-bit conversions, tensor-core and async-copy instructions as inline PTX
    "pnca/layout.cu",          # what the kernel does, its arguments, constants and shared-memory carve-up
    "pnca/statistics.cu",      # step 1: the rows' mean and rstd over the full model dim
    "pnca/q_fragments.cu",     # step 2: one head's Q = norm(x slice), as mma A fragments
    "pnca/stage_loads.cu",     # the 16-byte copies that fill a pipeline stage
    "pnca/attend.cu",          # step 3: online-softmax attention over one K/V tile
    "pnca/epilogue.cu",        # step 4: y = x + o (the key split and the chunk merge included)
    "pnca/kernel.cu",          # the step sequence, the pipeline along it, and the kernel
)
# TileConfig.producer: the same steps in warp-specialised form (a producer warpgroup fills the stages), with its own
# main loop in place of attend.cu's
WS_TEMPLATES = tuple(t for t in TEMPLATES if t not in ("pnca/attend.cu", "pnca/kernel.cu")) + ("pnca/kernel_ws.cu",)


@lru_cache(maxsize=None)
def _template(name: str) -> str:
    return (TEMPLATE_DIR / name).read_text()


def _cpp(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def config_constants(spec: KernelSpec) -> dict:
    t = spec.tile
    return {
        "ELEM_IS_BF16": spec.dtype == "bf16",
        "HEAD_DIM": spec.head_dim,
        "WARPS": t.warps,
        "M_TILES": t.m_tiles,
        "BLOCK_N": t.block_n,
        "KEY_SPLIT": t.key_split,
        "STAGES": t.stages,
        "ONE_TILE": t.one_tile,
        "USE_WGMMA": t.wgmma,
        "USE_TMA": t.tma,
        "ROWSUM_IN_PV": spec.rowsum_in_pv,
        "KV_SWIZZLED": spec.kv_swizzled,
        "Q_IN_SMEM": spec.q_in_smem,
        "NORM_IS_RMS": spec.norm == "rms",
        "HAS_GAMMA": spec.has_gamma,
        "HAS_BETA": spec.has_beta,
        "AFFINE_IS_F32": spec.affine_f32,
        "MASK_KIND": {"none": 0, "bool": 1, "add": 2}[spec.mask],
        "MASK_IS_F32": spec.mask_f32,
        "CHECK_NUMERICS": spec.check_numerics,
        "Q_FROM_QRAW": spec.q_from_qraw,
        "WRITE_O": spec.write_o,
        "GROUPED_STATS": spec.grouped_stats,
        "SMEM_BYTES": spec.smem_bytes(),
        "MIN_CTAS_PER_SM": spec.min_ctas_per_sm,
    }


def wgmma_helpers(spec: KernelSpec) -> str:
    """The three warpgroup mma shapes a USE_WGMMA kernel issues (see templates/prelude.cu), as inline PTX: the scores
    S = Q K^T (N = BLOCK_N keys, K read K-major), the output O += P V (N = head dim, V read N-major: transposed B;
    with ``rowsum_in_pv`` 8 columns more, read from a block of ones: the row sums) and otherwise the row sums
    l += P 1 (N = 8, a block of ones read K-major).
    Each has one operand per accumulator register, too many to write by hand. Other kernels get empty stand-ins:
    the calls sit in discarded ``if constexpr`` branches there, which must still name defined functions."""
    ab = spec.dtype.replace("fp", "f")  # bf16 / f16
    out = []
    output_n = spec.head_dim + (8 if spec.rowsum_in_pv else 0)
    for name, n, trans_b in (("wgmma_scores", spec.tile.block_n, 0), ("wgmma_output", output_n, 1),
                             ("wgmma_row_sums", 8, 0)):
        if not spec.tile.wgmma:
            out.append(f"FN_INLINE void {name}(float (&d)[{max(n // 8, 1)}][4], const u32 (&a)[4], u64 b_desc, "
                       f"bool accumulate) {{}}  // not a wgmma kernel: never called")
            continue
        regs = n // 2
        acc = ", ".join(f"%{i}" for i in range(regs))
        a = ", ".join(f"%{regs + i}" for i in range(4))
        operands = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(regs))
        out.append(
            f"// D (64 x {n}, fp32) {'+' if trans_b else ''}= A (64 x 16, registers) * B (16 x {n}, shared memory); "
            f"accumulate = false overwrites D.\n"
            f"FN_INLINE void {name}(float (&d)[{n // 8}][4], const u32 (&a)[4], u64 b_desc, bool accumulate) {{\n"
            f'  asm volatile(\n'
            f'      "{{\\n.reg .pred acc;\\nsetp.ne.b32 acc, %{regs + 4}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{acc}}}, {{{a}}}, %{regs + 5}, acc, 1, 1, '
            f'{trans_b};\\n}}\\n"\n'
            f"      : {operands}\n"
            f'      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"((u32)accumulate), "l"(b_desc));\n'
            f"}}")
    return "\n".join(out)


def render(spec: KernelSpec) -> str:
    lines = [f"// fusednorm generated kernel {spec.key}", "// configuration (fusednorm/codegen/render.py)"]
    for name, value in config_constants(spec).items():
        ctype = "bool" if isinstance(value, bool) else "int"
        lines.append(f"constexpr {ctype} {name} = {_cpp(value)};")
    lines.append(f"#define KERNEL_NAME {spec.key}")
    parts = ["\n".join(lines)]
    for name in WS_TEMPLATES if spec.tile.producer else TEMPLATES:
        parts.append(f"// ---- templates/{name} ----\n" + _template(name))
        if name == "prelude.cu":
            parts.append("// ---- warpgroup mma shapes (fusednorm/codegen/render.py) ----\n" + wgmma_helpers(spec))
    return "\n\n".join(parts)
