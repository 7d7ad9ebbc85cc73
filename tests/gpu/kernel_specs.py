"""The kernels tests/gpu/test_kernel_gpu.py compiles, without a GPU: the test compiles them up front on the device,
and bench/prebuild_kernels.py compiles the same set ahead of a device run (its cold compiles cost ~200 s there)."""
from __future__ import annotations

import itertools

from fusednorm.codegen.spec import HEAD_DIMS, TILE_ROLES, KernelSpec, tile_for

DTYPES = ("bf16", "fp16")
NORMS = ("layer_affine", "layer_plain", "rms")
MASKS = ("none", "bool", "add")


def tile_sets(arch: int) -> list[str]:
    """On sm_90 the native tiles of head dims 64 and 128 use the warpgroup mma; the sm_80 tiles (mma.sync, what
    every other GPU runs) are tested there too, swapped in through codegen.tile_for."""
    return ["native"] + (["sm80_tiles"] if arch == 90 else [])


def tiles_of(tile_set: str):
    if tile_set == "sm80_tiles":
        return lambda role, d, arch=80, stage=False: tile_for(role, d, 80, stage)
    return tile_for


def family_specs(arch, dtype, d, norm_variant, mask, mask_f32=False, check=False, tiles=tile_for):
    """One kernel per tile role for these inputs (what one call may pick from)."""
    norm = "rms" if norm_variant == "rms" else "layer"
    has_g = norm_variant in ("layer_affine", "rms")
    has_b = norm_variant == "layer_affine"
    kind = "none" if mask == "none" else ("bool" if mask == "bool" else "add")
    return [KernelSpec(dtype, d, norm, has_g, has_b, False, kind, mask_f32, tiles(r, d, arch), arch, check)
            for r in TILE_ROLES]


def kernel_test_specs(arch: int) -> list[KernelSpec]:
    """Every kernel the GPU kernel tests launch on a GPU of this arch, each key once."""
    specs = []
    for tile_set, dtype, d, norm, mask in itertools.product(tile_sets(arch), DTYPES, HEAD_DIMS, NORMS, MASKS):
        specs += family_specs(arch, dtype, d, norm, mask, tiles=tiles_of(tile_set))
    specs += family_specs(arch, "bf16", 64, "layer_affine", "none", check=True)
    specs += family_specs(arch, "bf16", 64, "layer_affine", "add", mask_f32=True)
    return list({s.key: s for s in specs}.values())
