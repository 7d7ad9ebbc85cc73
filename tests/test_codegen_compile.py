"""Every spec of the supported grid compiles with NVRTC for sm_80 and sm_90 with no spills (CPU only)."""
from __future__ import annotations

import itertools
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc")

from fusednorm.codegen import select, why_no_kernel  # noqa: E402
from fusednorm.codegen.nvrtc import (compile_to_cubin, load_builtins_beside_nvrtc, nvrtc_version,  # noqa: E402
                                     parse_ptxas_report)
from fusednorm.codegen.render import render  # noqa: E402
from fusednorm.codegen.spec import (FINE_KEYS, HEAD_DIMS, TILE_ROLES, KernelSpec,  # noqa: E402
                                    supported_grid, tile_for)

GRID = supported_grid()
H100_SMEM_PER_BLOCK = 227 * 1024
A100_SMEM_PER_BLOCK = 163 * 1024


def _compile(spec: KernelSpec):
    _, usage, _ = compile_to_cubin(render(spec), spec.key, spec.arch)
    return spec.key, usage


@pytest.fixture(scope="module")
def compiled_grid():
    """The whole grid compiled once, in parallel (NVRTC is CPU-bound; CI has 2 cores)."""
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        return dict(pool.map(_compile, GRID, chunksize=4))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_nvrtc_builtins_are_loaded_from_the_folder_libnvrtc_came_from():
    # torch 2.14's CUDA builds pin an nvidia-cuda-nvrtc whose libnvrtc has no run path: its builtins must be loaded
    path = load_builtins_beside_nvrtc()
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if "/libnvrtc" in line}
    assert path is not None and path in mapped
    assert os.path.basename(path) == f"libnvrtc-builtins.so.{nvrtc_version()}"
    assert any(os.path.dirname(p) == os.path.dirname(path) and "/libnvrtc.so" in p for p in mapped)


def test_grid_covers_every_dtype_head_dim_role_and_arch():
    seen = {(s.dtype, s.head_dim, s.tile, s.arch) for s in GRID}
    for arch in (80, 90):
        for dtype in ("bf16", "fp16"):
            for d in HEAD_DIMS:
                for role in TILE_ROLES:
                    assert (dtype, d, tile_for(role, d, arch), arch) in seen
    assert {s.mask for s in GRID} == {"none", "bool", "add"}
    assert {s.norm for s in GRID} == {"layer", "rms"}
    assert len({s.key for s in GRID}) == len(GRID), "keys must name kernels uniquely"


@pytest.mark.parametrize("key", [s.key for s in GRID])
def test_compiles_without_spills(compiled_grid, key):
    usage = compiled_grid[key]
    assert 0 < usage.registers <= 255
    assert (usage.spill_stores, usage.spill_loads, usage.stack_frame) == (0, 0, 0), f"{key}: {usage}"


@pytest.mark.parametrize("spec", GRID, ids=[s.key for s in GRID])
def test_shared_memory_fits(spec):
    limit = A100_SMEM_PER_BLOCK if spec.arch == 80 else H100_SMEM_PER_BLOCK
    assert spec.smem_bytes() <= limit


def test_key_is_readable_and_length_free():
    spec = KernelSpec("bf16", 64, "layer", True, True, False, "bool", False, tile_for("base", 64), 90, False)
    assert spec.key == "pnca_bf16_d64_layer_gb_mbool_t64x64_sm90"
    rms = KernelSpec("fp16", 40, "rms", False, False, True, "add", True, tile_for("short", 40), 80, True)
    assert rms.key == "pnca_fp16_d40_rms_noaff_madd32_t16x16k4s4_sm80_chk"  # affine_f32 dropped: nothing to store


def test_sm90_tiles_use_the_warpgroup_mma_unserialized():
    """On sm_90 the base, long and few_keys tiles of head dims 64 and 128 issue wgmma; ptxas must keep them
    asynchronous (it serializes them, and says so, when it cannot prove the registers in flight are left alone)."""
    wgmma = [s for s in GRID if s.tile.wgmma]
    assert {(s.head_dim, s.arch) for s in wgmma} == {(64, 90), (128, 90)}
    assert all(tile_for(r, d, 90).wgmma for r in ("base", "long", "few_keys") for d in (64, 128))
    assert not any(tile_for(r, d, 80).wgmma or tile_for(r, 40, 90).wgmma for r in TILE_ROLES for d in (64, 128))
    for spec in (next(s for s in wgmma if s.tile.one_tile and s.head_dim == 64),
                 next(s for s in wgmma if s.tile == tile_for("long", 128, 90))):
        src = render(spec)
        assert "wgmma.mma_async.sync.aligned.m64n" in src
        _, usage, log_text = compile_to_cubin(src, spec.key, spec.arch)
        assert "serialized" not in log_text, log_text
        assert usage.spill_stores in (0, None)


def test_source_needs_no_headers():
    src = render(GRID[0])
    assert "#include" not in src
    assert f"#define KERNEL_NAME {GRID[0].key}" in src


def test_compile_error_carries_the_log():
    from fusednorm.codegen.nvrtc import NvrtcError

    with pytest.raises(NvrtcError, match="undefined"):
        compile_to_cubin('extern "C" __global__ void broken() { undefined_thing(); }', "broken", 90)


def test_ptxas_report_parsing():
    text = ("ptxas info    : Compiling entry function 'kern' for 'sm_90'\n"
            "ptxas info    : Function properties for kern\n"
            "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem\n")
    u = parse_ptxas_report(text, "kern")
    assert (u.registers, u.stack_frame, u.spill_stores, u.spill_loads, u.static_smem) == (255, 16, 8, 12, 1024)


# ---- run-time choices (no GPU needed) ----

def test_usage_read_from_the_cubin_matches_ptxas_report(monkeypatch):
    """NVRTC serves repeat builds from the CUDA compute cache without ptxas's report (on machines with a driver):
    the registers and stack frame then come from the cubin, and agree with the report."""
    from fusednorm.codegen import nvrtc

    spec = KernelSpec("bf16", 64, "layer", True, True, False, "none", False, tile_for("few_keys", 64), 90, False)
    local = ('extern "C" __global__ void framed(float* o, int i) { float a[256];\n#pragma unroll 1\n'
             "  for (int j = 0; j < 256; ++j) a[j] = o[j] * j;\n  o[0] = a[i & 255]; }")
    for source, name in ((render(spec), spec.key), (local, "framed")):
        cubin, report, _ = nvrtc.compile_to_cubin(source, name, 90)
        read = nvrtc.usage_from_cubin(cubin, name)
        assert (read.registers, read.stack_frame) == (report.registers, report.stack_frame), name
        assert read.spill_stores is None and read.spill_loads is None
    assert report.stack_frame > 0  # the local array lives in the stack frame, which the cubin records too

    real = nvrtc._compile
    monkeypatch.setattr(nvrtc, "_compile", lambda src, name, arch: (real(src, name, arch)[0], ""))
    _, served, log_text = nvrtc.compile_to_cubin(local, "framed", 90)
    assert log_text == "" and served == read
    with pytest.raises(nvrtc.NvrtcError, match="records no register count"):
        nvrtc.usage_from_cubin(cubin, "not_in_this_cubin")


def test_role_follows_lengths():
    assert select.tile_role(1, 1500, 64, 20) == "short"                 # Whisper decode
    assert select.tile_role(1, 77, 64, 20) == "short"                   # decode with few keys: still short
    assert select.tile_role(2048, 77, 32, 16) == "few_keys"             # seed: 77 keys fit one stage
    assert select.tile_role(4096, 77, 2, 10) == "few_keys"              # SDXL
    assert select.tile_role(17, 80, 2, 10) == "few_keys"                # the longest Lk one stage takes
    assert select.tile_role(2048, 77, 32, 16, stage=True) == "few_keys"  # the plan's stage: 128-row items fill
    assert select.tile_role(1024, 77, 2, 20, stage=True) == "base"       # the GPU 4 times over (not SDXL 32x32)
    assert select.tile_role(2048, 77, 32, 16, stage=True, few_keys=False) == "long"  # its kernel at 1 CTA per SM
    assert select.tile_role(448, 1500, 16, 20) == "many_keys"           # Whisper prefill
    assert select.tile_role(1792, 1500, 16, 20) == "many_keys"          # the same keys, 4x the query rows
    assert select.tile_role(2048, 2048, 32, 16) == "long"               # Lk 2048: whole 128-key stages
    assert select.tile_role(448, 1500, 16, 20, stage=True) == "long"  # the stage: many_keys only warp-specialised
    assert select.tile_role(448, 1023, 16, 20) == "long"                # below MANY_KEYS
    assert select.tile_role(128, 512, 32, 16) == "long"                 # T5 decoder block: long keys
    assert select.tile_role(300, 81, 2, 8) == "base"                    # a few short items
    assert select.tile_role(2048, 81, 32, 16) == "long"                 # many 128-row items
    assert select.tile_role(2048, 81, 32, 16, sm_count=2000) == "base"  # a bigger GPU wants more items


def test_softmax_scale_reaches_the_kernel_in_log2_units():
    from fusednorm.codegen import _scale_log2
    log2e = 1.4426950408889634
    for d in HEAD_DIMS:  # the default is 1 / sqrt(d)
        assert _scale_log2(None, d) == d ** -0.5 * log2e
    for scale in (1.0, 50.0, 1e-4, 0.0, -2.0):  # as given (a scale <= 0 takes the kernel's pre-scaled path)
        assert _scale_log2(scale, 64) == scale * log2e


def test_many_keys_tile_is_the_long_tile_except_on_sm90_with_small_heads():
    for d in HEAD_DIMS:
        assert tile_for("many_keys", d, 80) == tile_for("long", d, 80)
        assert (tile_for("many_keys", d, 90) == tile_for("long", d, 90)) == (d != 64)
    tile = tile_for("many_keys", 64, 90)
    assert tile.token == "t64x112wgtma"
    plain = KernelSpec("bf16", 64, "layer", True, True, False, "none", False, tile, 90, False)
    stage = KernelSpec("bf16", 64, "layer", False, False, False, "none", False, tile, 90, False, q_from_qraw=True)
    assert (plain.min_ctas_per_sm, stage.min_ctas_per_sm) == (3, 1)
    assert 3 * (plain.smem_bytes() + 1024) <= 228 * 1024  # three CTAs' shared memory (+1 KB each) fit on an SM


def test_warp_specialised_tile_is_sm90_many_keys_for_plain_blocks():
    """many_keys on sm_90 with d = 64 is kernel_ws.cu's tile wherever the spec can take it (no mask; the plan's stage
    too): a producer warpgroup and two consumer warpgroups (384 threads), three stages of 128 keys, 1 CTA per SM,
    every row's statistics summed whole (its consumers may hold no CTA barrier); it takes every Lk from MANY_KEYS
    on, in four stages of 96 keys (many_keys_fine) wherever those pad Lk no further. Both compile without spills and
    with every wgmma left asynchronous (ptxas warns when it serializes them)."""
    from dataclasses import replace

    ws = tile_for("many_keys", 64, 90, warp_specialised=True)
    assert ws.producer and ws.token == "t128x128w8s3wgtmaws" and ws.threads == 384
    assert tile_for("many_keys", 64, 90, stage=True, warp_specialised=True) == ws
    assert not tile_for("many_keys", 64, 90, stage=True).producer  # (a mask)
    assert not any(tile_for(r, d, a, warp_specialised=True).producer for r in TILE_ROLES for d in HEAD_DIMS
                   for a in (80, 90) if (r, d, a) not in (("many_keys", 64, 90), ("many_keys_fine", 64, 90)))
    fine = tile_for("many_keys_fine", 64, 90, warp_specialised=True)
    assert fine.token == "t128x96w8s4wgtmaws" and fine.block_n == FINE_KEYS
    assert all(tile_for("many_keys_fine", d, a, stage, w) == tile_for("many_keys", d, a, stage, w)
               for d in HEAD_DIMS for a in (80, 90) for stage in (False, True) for w in (False, True)
               if (d, a, w) != (64, 90, True))
    for tile in (ws, fine):
        spec = KernelSpec("fp16", 64, "layer", True, True, True, "none", False, tile, 90, True)
        assert spec.min_ctas_per_sm == 1 and not spec.grouped_stats and spec.rowsum_in_pv
        assert spec.smem_bytes() + 1024 <= 228 * 1024
        src = render(spec)
        assert "setmaxnreg.dec" in src and "attend_tile" not in src
        _, usage, log_text = compile_to_cubin(src, spec.key, 90)
        assert (usage.spill_stores, usage.spill_loads) == (0, 0)
        assert "serialized" not in log_text, log_text  # any of ptxas's wgmma warnings (C7510-C7517)
    for other in (dict(mask="bool"), dict(head_dim=128)):
        with pytest.raises(ValueError, match="warp-specialised"):
            replace(spec, **other)
    stage = replace(spec, has_gamma=False, has_beta=False, affine_f32=False, q_from_qraw=True, write_o=True)
    assert stage.key in {s.key for s in supported_grid()}  # compiled (and checked for spills) in CI
    assert select.tile_role(2048, 2048, 32, 16, many_keys_ws=True) == "many_keys"  # whole 128-key stages too
    assert select.tile_role(448, 1250, 16, 20, many_keys_ws=True) == "many_keys"  # 14 stages of 96 would pad more
    assert select.tile_role(448, 1500, 16, 20, many_keys_ws=True) == "many_keys_fine"  # 16 of 96 keys, or 12 of 128
    assert select.tile_role(448, 1024, 16, 20, many_keys_ws=True) == "many_keys"
    assert select.tile_role(448, 1057, 16, 20, many_keys_ws=True) == "many_keys_fine"
    assert select.tile_role(448, 1023, 16, 20, many_keys_ws=True) == "long"
    assert select.tile_role(448, 1500, 16, 20, stage=True, many_keys_ws=True) == "many_keys_fine"  # the plan's
    assert select.tile_role(2048, 2048, 32, 16, stage=True, many_keys_ws=True) == "many_keys"


def test_warp_specialised_exponentials_run_while_the_p_v_does():
    """In kernel_ws.cu's main loop a tile's softmax sits between the previous tile's P V issue and the wait for it,
    so that the tensor cores and the exponentials run at once. ptxas hoists that wait into the row maximum's first
    stall unless a basic-block boundary holds it (block_boundary): the SASS then had no exponential between them.
    Read from the machine code: every overlap (inner and last tile, both signs of the scale) holds most of the
    tile's exponentials per lane (64 with 128-key stages, 48 with 96), in the plan's stage too (q from qraw)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from sass_census import disassemble, find_nvdisasm

    nvdisasm = find_nvdisasm()
    assert nvdisasm is not None, "the test extra installs nvidia-cuda-nvdisasm"
    for role, stage in itertools.product(("many_keys", "many_keys_fine"), (False, True)):
        ws = tile_for(role, 64, 90, warp_specialised=True)
        spec = KernelSpec("bf16", 64, "layer", not stage, not stage, False, "none", False, ws, 90, False,
                          q_from_qraw=stage, write_o=stage)
        sass = disassemble(compile_to_cubin(render(spec), spec.key, 90)[0], nvdisasm)
        overlaps = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1 ;(.*?)WARPGROUP\.DEPBAR\.LE gsb0, 0x0 ;", sass, re.S)
        exponentials = [block.count("MUFU.EX2") for block in overlaps]
        per_lane = ws.block_n // 2  # 16 rows by block_n keys over 32 lanes
        assert len(exponentials) == 4 and min(exponentials) >= per_lane * 3 // 4, (role, stage, exponentials)


def test_sm90_long_tile_for_small_heads_takes_128_rows_but_the_plan_stage_keeps_64():
    """The projection-free long role on sm_90 with d = 64 runs two warpgroups over 128 rows (each K/V stage shared),
    2 CTAs per SM at 128 registers; the plan's stage mode, whose folded Q needs registers, keeps the 64-row tile."""
    free, stage_tile = tile_for("long", 64, 90), tile_for("long", 64, 90, stage=True)
    assert (free.token, stage_tile.token) == ("t128x64w8wgtma", "t64x128wgtma")
    assert all(tile_for(r, d, a, stage=True) == tile_for(r, d, a) for r in TILE_ROLES for d in HEAD_DIMS
               for a in (80, 90) if (r, d, a) != ("long", 64, 90))
    plain = KernelSpec("bf16", 64, "layer", True, True, True, "add", True, free, 90, True)
    assert plain.min_ctas_per_sm == 2 and 2 * (plain.smem_bytes() + 1024) <= 228 * 1024
    stage = KernelSpec("bf16", 64, "layer", False, False, False, "add", True, stage_tile, 90, True, q_from_qraw=True,
                       write_o=True)
    assert stage.min_ctas_per_sm == 2
    grid = {s.key: s for s in supported_grid()}
    assert plain.key in grid and stage.key in grid  # both compiled (and checked for spills) in CI


def test_decode_tile_takes_wide_swizzled_steps_at_two_ctas_per_sm():
    """The short (decode) tile for d = 64 takes 192 keys per step in 2 stages; its K/V stages are swizzled
    (unpadded) and the key split merges inside a stage, which is what lets 2 CTAs fit per SM. Key-split tiles
    swizzle only where a thread's copied rows share one swizzle phase (d = 256's 2 warps do not); d = 40 pads."""
    from fusednorm.codegen import render

    def spec(d, arch=90, role="short"):
        return KernelSpec("bf16", d, "layer", True, True, False, "none", False, tile_for(role, d, arch), arch, False)

    decode = spec(64)
    assert decode.tile.token == "t16x48k4" and decode.kv_swizzled
    assert 2 * (decode.smem_bytes() + 1024) <= 228 * 1024
    stage = KernelSpec("bf16", 64, "rms", False, False, False, "bool", False, tile_for("short", 64, 90), 90, False,
                       q_from_qraw=True, write_o=True)  # the projection plan's decode stage fits as many
    assert 2 * (stage.smem_bytes() + 1024) <= 228 * 1024
    assert "constexpr bool KV_SWIZZLED = true;" in render.render(decode)
    assert spec(64, 80).kv_swizzled and spec(128).kv_swizzled  # a layout choice, not an sm_90 feature
    assert not spec(256).kv_swizzled and not spec(40).kv_swizzled and not spec(80).kv_swizzled
    assert "constexpr bool KV_SWIZZLED = false;" in render.render(spec(256))
    assert not spec(64, role="few_keys", arch=80).kv_swizzled  # mma.sync tiles without a key split keep padded rows
    assert spec(64, role="few_keys").kv_swizzled  # the sm_90 wgmma tiles read the swizzled layout
    assert decode.smem_bytes() < 2 * 2 * 192 * (64 + 8) * 2  # less than its K/V stages alone would take padded


def test_row_sums_ride_in_the_p_v_wgmma_where_the_ones_block_fits():
    """d = 64 wgmma tiles fold the row sums into P V (m64n72k16: a V-sized block of ones one block-step past V)
    wherever that block leaves the CTAs per SM the tile is built for; many_keys' 3 CTAs per SM do not fit it and
    keep the separate row-sum wgmma. The rendered source and the shared-memory size follow the choice."""
    from fusednorm.codegen import render

    def spec(role, d=64):
        return KernelSpec("bf16", d, "layer", True, True, False, "none", False, tile_for(role, d, 90), 90, False)

    for role in ("few_keys", "long", "base"):
        s = spec(role)
        assert s.rowsum_in_pv, role
        assert s.min_ctas_per_sm * (s.smem_bytes() + 1024) <= 228 * 1024
        assert "constexpr bool ROWSUM_IN_PV = true;" in render.render(s)
    many = spec("many_keys")
    assert not many.rowsum_in_pv and many.min_ctas_per_sm == 3
    assert "constexpr bool ROWSUM_IN_PV = false;" in render.render(many)
    assert not spec("long", 128).rowsum_in_pv  # V is two 64-column blocks: the ones have no block-step of their own


def test_sm90_wgmma_stages_come_by_bulk_tensor_copies():
    """Every sm_90 warpgroup-mma tile fills its stages with TMA (one thread, bulk copies on an mbarrier): the source
    says so, its x slots are unpadded; the plan's stage mode too (its x slots stage o for the stores)."""
    from dataclasses import replace

    for d in (64, 128):
        for role in ("few_keys", "long", "many_keys", "base"):
            tile = tile_for(role, d, 90)
            assert tile.tma and tile.token.endswith("wgtma")
            spec = KernelSpec("bf16", d, "layer", True, True, False, "none", False, tile, 90, False)
            src = render(spec)
            assert "constexpr bool USE_TMA = true;" in src and "cp.async.bulk.tensor.4d" in src
            plain = spec.with_tile(replace(tile, tma=False))
            assert "constexpr bool USE_TMA = false;" in render(plain)
            # K/V stages are the same size; the x slots lose their 16-byte row pad and gain one mbarrier per stage
            assert spec.smem_bytes() - plain.smem_bytes() == tile.stages * (8 - tile.block_m * 16)
            stage = KernelSpec("bf16", d, "layer", False, False, False, "none", False, tile, 90, False,
                               q_from_qraw=True, write_o=True)
            assert stage.tile.tma and stage.key.endswith("wgtma_sm90")
    # and the mma.sync few-key tile of d = 40 (unpadded rows, see the next test); nothing else, and nothing on sm_80
    assert all(tile_for(r, d, a).tma == (tile_for(r, d, a).wgmma or (r, d, a) == ("few_keys", 40, 90))
               for r in TILE_ROLES for d in HEAD_DIMS for a in (80, 90))
    with pytest.raises(ValueError, match="bulk tensor copies"):
        KernelSpec("bf16", 64, "layer", True, True, False, "none", False, replace(tile_for("base", 64, 80), tma=True),
                   80, False)
    for d, arch in ((40, 80), (80, 90), (32, 90)):  # d = 40 on sm_80; 10 or 4 chunks a row: banks would clash
        with pytest.raises(ValueError, match="bulk tensor copies"):
            KernelSpec("bf16", d, "layer", True, True, False, "none", False,
                       replace(tile_for("few_keys", d, arch), tma=True), arch, False)


def test_d40_few_key_stages_are_unpadded_bulk_copies_on_sm90():
    """d = 40 rows are 5 chunks of 16 bytes: unpadded, 8 consecutive rows still fall on distinct banks, so on sm_90
    the few-key tile's stages, x slots and y stores are bulk tensor copies of whole 80-byte rows (the head's K, V
    and x slice one box each). QK^T's last k-step is m16n8k8 (columns 32..39) on every d = 40 kernel, so no pad
    column is read, none is zeroed, and the padded kernels (sm_80, the other roles) keep working without it."""
    from dataclasses import replace

    tile = tile_for("few_keys", 40, 90)
    assert tile.tma and not tile.wgmma and tile.token == "t128x80w8onetma"
    spec = KernelSpec("bf16", 40, "layer", True, True, False, "none", False, tile, 90, False)
    src = render(spec)
    assert "constexpr bool USE_TMA = true;" in src and "constexpr bool USE_WGMMA = false;" in src
    assert "m16n8k8" in src and "cp.async.bulk.tensor.4d" in src
    padded = spec.with_tile(replace(tile, tma=False))
    # K/V rows and x rows lose the pad to 48 columns and the 8 more of the bank stagger: 80 bytes instead of 112
    kv = 2 * tile.stages * tile.kv_rows * 32
    x = tile.stages * tile.block_m * 32
    assert padded.smem_bytes() - spec.smem_bytes() == kv + x - tile.stages * 8
    for mask in ("none", "bool"):
        stage = KernelSpec("bf16", 40, "layer", False, False, False, mask, False, tile_for("few_keys", 40, 90, True),
                           90, False, q_from_qraw=True, write_o=True)
        assert stage.tile.tma and stage.key.endswith("onetma_sm90")


def test_tensor_map_describes_only_aligned_16_byte_strides():
    from fusednorm.codegen.tensormap import describable

    B, H, Lk, d = 2, 4, 77, 64
    view = (d, Lk, H, B)  # k as [B, Lk, H, d] viewed as [B, H, Lk, d], innermost first
    assert describable(1 << 20, view, (1, H * d, d, Lk * H * d))
    assert not describable((1 << 20) + 8, view, (1, H * d, d, Lk * H * d))   # base not 16-byte aligned
    assert not describable(1 << 20, view, (2, H * d, d, Lk * H * d))         # inner dim strided
    assert not describable(1 << 20, view, (1, H * d, d, 0))                  # batch broadcast
    assert not describable(1 << 20, view, (1, H * d + 4, d, Lk * H * d))     # rows 8 bytes apart
    assert describable(1 << 20, (d, Lk, 1, 1), (1, d, 0, 3))                 # size-1 dims: stride unused


def test_few_keys_role_never_takes_more_keys_than_its_stage(monkeypatch):
    monkeypatch.setattr(select, "force_role", "few_keys")
    assert select.tile_role(2048, 80, 32, 16) == "few_keys"
    assert select.tile_role(2048, 81, 32, 16) == "base"
    for d in HEAD_DIMS:
        tile = tile_for("few_keys", d)
        assert not tile.one_tile or tile.block_n == select.FEW_KEYS


def test_decode_plan_splits_heads_and_respects_sm_count():
    tile = tile_for("short", 64)
    plan = select.plan_launch("short", tile, 64, 1, 1500, 20, 64, sm_count=132, ctas_per_sm=2)
    assert plan.heads_per_item < 20 and plan.items >= 132
    small = select.plan_launch("short", tile, 64, 1, 1500, 20, 64, sm_count=7, ctas_per_sm=2)
    assert small.grid <= 7 * 2


def test_decode_at_small_batch_splits_each_heads_keys_between_ctas():
    """Flash-decoding's split: with fewer (batch, head) pairs than CTA slots, runs of key tiles become items of
    their own; with enough pairs nothing is split. Every run is non-empty, together they cover every key tile, and
    the device's SMs alone decide them (sm_count must not change a bit of the result)."""
    tile = tile_for("short", 64, 90)
    key_tiles = -(-1500 // tile.kv_rows)
    split = {}
    for B in (1, 2, 4, 8, 16, 32, 64):
        p = select.plan_launch("short", tile, B, 1, 1500, 20, 64, sm_count=132, ctas_per_sm=2)
        assert p.chunk_tiles * p.kv_chunks >= key_tiles > p.chunk_tiles * (p.kv_chunks - 1)
        assert p.items == B * p.head_groups * p.kv_chunks and (p.kv_chunks == 1 or p.heads_per_item == 1)
        bounded = select.plan_launch("short", tile, B, 1, 1500, 20, 64, sm_count=7, ctas_per_sm=2, device_sms=132)
        assert (bounded.kv_chunks, bounded.chunk_tiles) == (p.kv_chunks, p.chunk_tiles) and bounded.grid <= 14
        split[B] = p.kv_chunks
    assert split[1] > 1 and split[4] == 1 and split[64] == 1
    long = tile_for("long", 64, 90)
    assert select.plan_launch("long", long, 1, 448, 1500, 20, 64, sm_count=132, ctas_per_sm=2).kv_chunks == 1
    # the H100 sweep (docs/PERF.md): 8 pairs fastest in 8 runs, 20 in 4 or 8, 80 and 320 unsplit
    assert select.key_chunks(pairs=8, key_tiles=8, slots=132) == (8, 1)
    assert select.key_chunks(pairs=20, key_tiles=8, slots=132) == (4, 2)
    assert select.key_chunks(pairs=80, key_tiles=8, slots=132) == (1, 8)
    assert select.key_chunks(pairs=320, key_tiles=8, slots=132) == (1, 8)


def test_plan_covers_every_row_and_head():
    for (B, Lq, Lk, H, d) in [(32, 2048, 77, 16, 64), (2, 4096, 77, 10, 64), (3, 129, 5, 7, 40), (1, 1, 1, 1, 32)]:
        role = select.tile_role(Lq, Lk, B, H)
        tile = tile_for(role, d)
        p = select.plan_launch(role, tile, B, Lq, Lk, H, d, sm_count=132, ctas_per_sm=3)
        assert p.row_blocks * tile.block_m >= Lq
        assert p.head_groups * p.heads_per_item >= H > (p.head_groups - 1) * p.heads_per_item
        assert p.items == B * p.row_blocks * p.head_groups * p.kv_chunks
        assert 1 <= p.grid <= min(p.items, 132 * 3)


def test_statistics_are_shared_where_one_wave_holds_a_row_blocks_head_groups(monkeypatch):
    """T5's decoder (D 1024, 8 head groups of one 128-row block, 256 items for 264 slots) sums each row's
    statistics in 8 column groups, one per item, and shares them, in a kernel that can (KernelSpec.grouped_stats).
    The groups follow the whole device: with sm_count bounding the grid the items are grouped otherwise or no
    longer run at once, so each sums every group itself (the same bits). The benchmarks' knob
    (bench/sweep_tiles.py --stat-groups 1) sums each row whole instead."""
    t5 = ("long", tile_for("long", 64, 90), 32, 128, 512, 16, 64)
    full = select.plan_launch(*t5, sm_count=132, ctas_per_sm=2, grouped_stats=True)
    assert (full.head_groups, full.items, full.stat_col_groups, full.share_stats) == (8, 256, 8, True)
    assert select.plan_launch(*t5, sm_count=132, ctas_per_sm=2).stat_col_groups == 1  # a kernel that cannot
    bounded = select.plan_launch(*t5, sm_count=100, ctas_per_sm=2, device_sms=132, grouped_stats=True)
    assert bounded.stat_col_groups == 8 and not bounded.share_stats and bounded.head_groups != 8  # its own G
    few = select.plan_launch(*t5, sm_count=20, ctas_per_sm=2, device_sms=132, grouped_stats=True)
    assert few.stat_col_groups == 8 and not few.share_stats
    t5_base = select.plan_launch(*t5[:5], 12, 64, sm_count=132, ctas_per_sm=2, model_dim=768, grouped_stats=True)
    assert t5_base.stat_col_groups == t5_base.head_groups > 1 and t5_base.share_stats
    # one pass per row: several waves (seed), one head group (SD 1.5), a narrow row (SDXL, D 640)
    long = tile_for("long", 64, 90)
    assert select.plan_launch("long", long, 32, 2048, 77, 16, 64, 132, 2).items > 264
    for args in (("long", long, 32, 2048, 77, 16, 64), ("long", tile_for("long", 40, 90), 8, 4096, 77, 8, 40),
                 ("long", long, 2, 4096, 77, 10, 64)):
        p = select.plan_launch(*args, sm_count=132, ctas_per_sm=2, grouped_stats=True)
        assert (p.stat_col_groups, p.share_stats) == (1, False), args
    monkeypatch.setattr(select, "force_stat_col_groups", 1)
    p = select.plan_launch(*t5, sm_count=132, ctas_per_sm=2, grouped_stats=True)
    assert (p.heads_per_item, p.items, p.stat_col_groups, p.share_stats) == (2, 256, 1, False)


def test_only_projection_free_kernels_with_a_heads_keys_in_stages_group_their_statistics():
    """KernelSpec.grouped_stats: the long and base tiles of the projection-free form. Not the one-tile kernels (they
    spilled with it), nor tiles whose warps hold two m-tiles (sm_80's long) or split keys (decode), nor the plan's
    stage (it measured slower); the template compiles the grouped pass only where the spec says so."""
    def spec(role, arch=90, stage=False):
        return KernelSpec("bf16", 64, "layer", True, True, False, "none", False, tile_for(role, 64, arch), arch, False,
                          stage, stage)
    assert spec("long").grouped_stats and spec("base").grouped_stats
    for no in (spec("few_keys"), spec("short"), spec("long", arch=80), spec("long", stage=True)):
        assert not no.grouped_stats, no.key
    assert "constexpr bool GROUPED_STATS = true;" in render(spec("long"))
    assert "constexpr bool GROUPED_STATS = false;" in render(spec("few_keys"))


def test_forced_heads_per_item_pins_g_and_still_covers_every_head(monkeypatch):
    # the benchmarks' knob (bench/sweep_tiles.py --groups): any G, even one the cost model would skip as uneven
    tile = tile_for("few_keys", 64)
    for g in (1, 3, 8, 10, 40):
        monkeypatch.setattr(select, "force_heads_per_item", g)
        p = select.plan_launch("few_keys", tile, 2, 4096, 77, 10, 64, sm_count=132, ctas_per_sm=2)
        assert p.heads_per_item == min(g, 10) and p.head_groups == -(-10 // min(g, 10))
        assert p.head_groups * p.heads_per_item >= 10 > (p.head_groups - 1) * p.heads_per_item


# ---- why_no_kernel works on fake / meta tensors ----

def _fake_inputs(dtype=torch.bfloat16, d=64, device="cuda"):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 4 * d, dtype=dtype, device=device)
        k = torch.empty(2, 4, 7, d, dtype=dtype, device=device)
    return x, k


def test_why_no_kernel_on_fake_tensors():
    x, k = _fake_inputs()
    if not torch.cuda.is_available():
        assert why_no_kernel(x, k, k, None, None, None, "layer") is None
    x32, k32 = _fake_inputs(torch.float32)
    assert "float32" in why_no_kernel(x32, k32, k32, None, None, None, "layer")
    x48, k48 = _fake_inputs(d=48)
    assert "head dim 48" in why_no_kernel(x48, k48, k48, None, None, None, "layer")
    xm = torch.empty(2, 5, 256, dtype=torch.bfloat16, device="meta")
    km = torch.empty(2, 4, 7, 64, dtype=torch.bfloat16, device="meta")
    assert "not on a CUDA device" in why_no_kernel(xm, km, km, None, None, None, "layer")


def test_the_plan_refuses_a_model_dim_of_rows_not_whole_16_byte_chunks():
    """With Wq the model dim D is free (T5's inner dim differs from it); the stage reads x's rows in 16-byte chunks,
    so D = 204 would read misaligned (an H100 raised 'misaligned address'): the plan says why and the reference
    runs instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusednorm.plans import why_no_plan

    with FakeTensorMode():
        k = torch.empty(2, 4, 7, 64, dtype=torch.bfloat16, device="cuda")
        for D in (200, 204):
            x = torch.empty(2, 5, D, dtype=torch.bfloat16, device="cuda")
            wq = torch.empty(256, D, dtype=torch.bfloat16, device="cuda")
            wo = torch.empty(D, 256, dtype=torch.bfloat16, device="cuda")
            reason = why_no_plan(x, k, k, None, None, wq, None, wo, None, None, "layer")
            if D == 204:
                assert "model dim 204 is not a multiple of 8" in reason
            elif not torch.cuda.is_available():
                assert reason is None
