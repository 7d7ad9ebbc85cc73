"""Spec -> CUDA source: the configuration constants, then the prelude and the kernel templates, verbatim."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .spec import KernelSpec

TEMPLATE_DIR = Path(__file__).parent / "templates"
TEMPLATES = ("prelude.cu", "pnca.cu")


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
        "SMEM_BYTES": spec.smem_bytes(),
        "MIN_CTAS_PER_SM": spec.min_ctas_per_sm,
    }


def render(spec: KernelSpec) -> str:
    lines = [f"// fusednorm generated kernel {spec.key}", "// configuration (fusednorm/codegen/render.py)"]
    for name, value in config_constants(spec).items():
        ctype = "bool" if isinstance(value, bool) else "int"
        lines.append(f"constexpr {ctype} {name} = {_cpp(value)};")
    lines.append(f"#define KERNEL_NAME {spec.key}")
    parts = ["\n".join(lines)]
    for name in TEMPLATES:
        parts.append(f"// ---- templates/{name} ----\n" + _template(name))
    return "\n\n".join(parts)
