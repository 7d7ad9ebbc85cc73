"""The kernels the GPU tests compile, listed without a GPU: tests/gpu/test_kernel_gpu.py compiles its own up front on
the device, and bench/prebuild_kernels.py compiles all of them ahead of a device run (cold compiles cost ~200 s
there)."""
from __future__ import annotations

import itertools
from dataclasses import replace

from fusednorm.codegen.spec import HEAD_DIMS, TILE_ROLES, KernelSpec, tile_for

DTYPES = ("bf16", "fp16")
NORMS = ("layer_affine", "layer_plain", "rms")
MASKS = ("none", "bool", "add")
# test_bulk_copy_stages_match_the_16_byte_copies_bit_for_bit: (head dim, mask) per role, d = 40 on few_keys only
TWIN_CASES = ((64, "none"), (64, "add"), (128, "bool"))
FEW_KEYS_TWIN_CASES = ((40, "none"), (40, "bool"))


def tile_sets(arch: int) -> list[str]:
    """On sm_90 the native tiles of head dims 64 and 128 use the warpgroup mma; the sm_80 tiles (mma.sync, what
    every other GPU runs) are tested there too, swapped in through codegen.tile_for."""
    return ["native"] + (["sm80_tiles"] if arch == 90 else [])


def tiles_of(tile_set: str):
    if tile_set == "sm80_tiles":
        return lambda role, d, arch=80, stage=False, warp_specialised=False: tile_for(role, d, 80, stage)
    return tile_for


def copy_twin_tiles(role, d, arch=80, stage=False, warp_specialised=False):
    """A tile with its bulk tensor copies (TMA) swapped for the 16-byte copies, the same math otherwise; for the
    warp-specialised tile (kernel_ws.cu) the same tile in kernel.cu, whose serial order does the same arithmetic."""
    return replace(tile_for(role, d, arch, stage, warp_specialised), tma=False, producer=False)


def family_specs(arch, dtype, d, norm_variant, mask, mask_f32=False, check=False, tiles=tile_for, affine_f32=False):
    """One kernel per tile role for these inputs (what one call may pick from). norm_variant "layer_gamma" is a
    LayerNorm without beta."""
    norm = "rms" if norm_variant == "rms" else "layer"
    has_g = norm_variant in ("layer_affine", "layer_gamma", "rms")
    has_b = norm_variant == "layer_affine"
    kind = "none" if mask == "none" else ("bool" if mask == "bool" else "add")
    return [KernelSpec(dtype, d, norm, has_g, has_b, affine_f32, kind, mask_f32,
                       tiles(r, d, arch, warp_specialised=kind == "none"), arch, check) for r in TILE_ROLES]


def kernel_test_specs(arch: int) -> list[KernelSpec]:
    """Every kernel the GPU kernel tests launch on a GPU of this arch, each key once."""
    specs = []
    for tile_set, dtype, d, norm, mask in itertools.product(tile_sets(arch), DTYPES, HEAD_DIMS, NORMS, MASKS):
        specs += family_specs(arch, dtype, d, norm, mask, tiles=tiles_of(tile_set))
    specs += family_specs(arch, "bf16", 64, "layer_affine", "none", check=True)
    specs += family_specs(arch, "bf16", 64, "layer_affine", "add", mask_f32=True)
    specs += family_specs(arch, "bf16", 64, "layer_affine", "none", affine_f32=True)  # fp32 norm parameters
    specs += family_specs(arch, "bf16", 64, "layer_gamma", "none")  # test_backend_gpu's dispatcher test
    if arch == 90:  # the bulk-copy tiles' 16-byte-copy twins (a tile without TMA is its own twin: one key)
        for d, mask in TWIN_CASES + FEW_KEYS_TWIN_CASES:
            specs += family_specs(arch, "bf16", d, "layer_affine", mask, tiles=copy_twin_tiles)
    return list({s.key: s for s in specs}.values())


def stage_family_specs(arch, dtype, d, norm, mask, q_from_qraw, write_o):
    """One kernel per tile role for the projection plan's attention stage (plans/__init__.py): with q from qraw,
    gamma and beta are folded into Wq' (the stage reads neither); else it reads them in x's dtype. Additive masks
    come in x's dtype."""
    has_gamma = not q_from_qraw
    has_beta = not q_from_qraw and norm == "layer"
    return [KernelSpec(dtype, d, norm, has_gamma, has_beta, False, mask, False,
                       tile_for(r, d, arch, stage=q_from_qraw, warp_specialised=mask == "none"), arch, False,
                       q_from_qraw, write_o) for r in TILE_ROLES]


def plan_test_specs(arch: int) -> list[KernelSpec]:
    """The stages tests/gpu/test_plan_gpu.py (and the backend tests' decoder layers) run: every projection variant
    at head dim 64 (Wq and Wo, Wq only, Wo only) with each norm and mask, and the full block at the other head dims
    it covers."""
    specs = []
    for dtype, norm, mask, (q_from_qraw, write_o) in itertools.product(
            DTYPES, ("layer", "rms"), MASKS, ((True, True), (True, False), (False, True))):
        specs += stage_family_specs(arch, dtype, 64, norm, mask, q_from_qraw, write_o)
    for d in (40, 80, 128, 160):
        specs += stage_family_specs(arch, "bf16", d, "layer", "bool", True, True)
    specs += stage_family_specs(arch, "bf16", 40, "layer", "none", True, True)  # the stage's few_keys tile
    return list({s.key: s for s in specs}.values())
