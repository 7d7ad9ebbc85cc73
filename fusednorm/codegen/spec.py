"""What a generated kernel is specialised on, and nothing else.

A ``KernelSpec`` holds every property that changes the generated code: element type, head dim, norm kind and its
affine parameters, mask kind, tile configuration, GPU arch and the numerics check. Batch, query length and key
length are never part of it: they are run-time arguments, and ``select.py`` picks among the few tile
configurations of a spec at run time. ``spec.key`` is one readable string that names the kernel, its cache entry
and its log lines, e.g. ``pnca_bf16_d64_layer_gb_mbool_t64x64_sm90``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

DTYPES = ("bf16", "fp16")
HEAD_DIMS = (32, 40, 64, 80, 96, 128, 160, 256)  # 160: SD-1.5's UNet at its 1280 channels (8 heads)
MASK_KINDS = ("none", "bool", "add")
ARCHS = (80, 90)  # what CI compiles for; any sm_8x / sm_9x device gets its own arch at run time

# Tile configurations are named by the query rows they cover at once (the seed's 128/256/512 idea, scaled to the
# lengths cross-attention meets): "short" for a handful of query rows (decode), "base", and "long"; "many_keys",
# the long role's tile for key lengths from MANY_KEYS on (an audio encoder's 1500 frames), and "many_keys_fine", its
# twin with stages of FINE_KEYS keys where those pad Lk no further than 128-key stages do (only the warp-specialised
# kernel has one; elsewhere it is the many_keys tile); and "few_keys" for key lengths up to FEW_KEYS (a text
# encoder's 77 tokens), where a head's keys fit one stage.
TILE_ROLES = ("short", "base", "long", "many_keys", "many_keys_fine", "few_keys")
FEW_KEYS = 80  # block_n of the few_keys tiles: the longest Lk they take
MANY_KEYS = 1024  # from this Lk on (see select.tile_role), the long role may take its many_keys tile
FINE_KEYS = 96  # block_n of the warp-specialised many_keys_fine tile


@dataclass(frozen=True)
class TileConfig:
    warps: int       # warps per CTA
    m_tiles: int     # 16-row m-tiles per warp
    block_n: int     # keys per warp per pipeline step
    key_split: int   # 1, or == warps: the warps share one m-tile and split each K/V stage between them
    stages: int      # pipeline depth (cp.async groups, or with tma mbarrier-tracked bulk copies)
    one_tile: bool = False  # a head's keys all in one stage (chosen only when Lk <= block_n): nothing carried
    wgmma: bool = False     # sm_90: QK^T and P V as warpgroup mma, B straight from shared memory (see WGMMA_HEAD_DIMS)
    tma: bool = False       # sm_90: stages filled by bulk tensor copies on an mbarrier (wgmma tiles, or dense_rows)
    producer: bool = False  # sm_90: one more warpgroup fills the stages; ``warps`` consume them (templates/pnca/
    #                         kernel_ws.cu, FlashAttention-3's warp specialisation)

    @property
    def threads(self) -> int:
        return 32 * self.warps + (128 if self.producer else 0)

    @property
    def rows_per_warp(self) -> int:
        return 16 * self.m_tiles

    @property
    def block_m(self) -> int:
        """Query rows per CTA work item."""
        return self.rows_per_warp if self.key_split > 1 else self.warps * self.rows_per_warp

    @property
    def kv_rows(self) -> int:
        """Keys per pipeline stage."""
        return self.block_n * self.key_split

    @property
    def token(self) -> str:
        t = f"t{self.block_m}x{self.block_n}"
        if self.warps != 4:
            t += f"w{self.warps}"
        if self.key_split > 1:
            t += f"k{self.key_split}"
        if self.stages != 2:
            t += f"s{self.stages}"
        if self.one_tile:
            t += "one"
        if self.wgmma:
            t += "wg"
        if self.tma:
            t += "tma"
        if self.producer:
            t += "ws"
        return t


def dense_rows_fit(head_dim: int) -> bool:
    """Rows of an odd number of 16-byte chunks (d = 40: 5): unpadded, any 8 consecutive rows of a stage still lie
    on distinct shared-memory banks for ldmatrix, so bulk tensor copies can fill the mma.sync tiles' stages."""
    return head_dim % 16 == 8


WGMMA_HEAD_DIMS = (64, 128)  # K/V rows of whole 128-byte swizzle blocks: what the warpgroup mma reads as laid out
# not "short": its warps split the keys (a warpgroup shares)
WGMMA_ROLES = ("base", "long", "many_keys", "many_keys_fine", "few_keys")


def tile_for(role: str, head_dim: int, arch: int = 80, stage: bool = False,
             warp_specialised: bool = False) -> TileConfig:
    """The tile configuration a role gets for a head dim on a GPU arch (register and shared-memory budgets decide;
    every one fits the 163 KB an sm_80 CTA may use). On sm_90 the roles in WGMMA_ROLES run on the warpgroup mma
    for the head dims it takes: one m-tile per warp, so that 4 warps make one 64-row wgmma tile. ``stage``: the
    tile is for the projection plan's attention stage (folded Q in, o out). ``warp_specialised``: the spec can take
    the warp-specialised kernel (no mask: KernelSpec checks), which sm_90's d-64 many_keys and many_keys_fine roles
    then get, in the plan's stage too."""
    if role == "many_keys_fine":
        if not (warp_specialised and arch == 90 and head_dim == 64):
            return tile_for("many_keys", head_dim, arch, stage, warp_specialised)  # the same kernel
        # 96-key stages, four of them: Whisper prefill (Lk 1500, 16 stages of 96 or 12 of 128 keys) 162-163 us
        # against the 128-key tile's 170-172 in the same calls on an H100; with Lk 2048 (22 stages against 16)
        # 1266-1299 against 1243-1250, so it takes only lengths it pads no further (docs/PERF.md,
        # thirty-eighth run): each head's first QK^T and last P V run outside the overlap, on smaller tiles here
        return TileConfig(warps=8, m_tiles=1, block_n=FINE_KEYS, key_split=1, stages=4, wgmma=True, tma=True,
                          producer=True)
    if role == "many_keys" and not (arch == 90 and head_dim == 64):
        return tile_for("long", head_dim, arch)  # only the sm_90 d-64 long tile has a many_keys variant
    if role == "many_keys" and warp_specialised:
        # warp-specialised (kernel_ws.cu): a producer warpgroup and two consumer warpgroups of 64 rows sharing
        # three 128-key stages, 1 CTA per SM, FlashAttention-3's overlap of softmax and P V. Against the long tile
        # in one run (H100): Whisper prefill 166-174 against 215-217 us, Lk 2048 1286-1296 against 1715-1721
        # (docs/PERF.md, thirty-sixth run)
        return TileConfig(warps=8, m_tiles=1, block_n=128, key_split=1, stages=3, wgmma=True, tma=True,
                          producer=True)
    if arch == 90 and head_dim in WGMMA_HEAD_DIMS and role in WGMMA_ROLES:
        # stages filled by bulk tensor copies, one thread issuing them (against the 16-byte-copy twins, same run:
        # seed -5.5 %, T5 -5 %, Whisper prefill -8.5 %; against the day's earlier kernel the few-key shapes are
        # level, T5 -3 %, prefill -7 %: docs/PERF.md, 12-03 sixth run)
        wg = dict(key_split=1, stages=2, wgmma=True, tma=True)
        if role == "few_keys":
            return TileConfig(warps=8, m_tiles=1, block_n=FEW_KEYS, one_tile=True, **wg)
        if role == "long" and head_dim == 64 and not stage:
            # 128 query rows, so two warpgroups share each K/V stage (half the K/V traffic of 64-row items), 64-key
            # stages, 2 CTAs per SM at 128 registers. Against t64x128 in one run: seed with Lk 2048 -5.8 %, T5
            # -1.2 %, Lk 2048 with 448 rows level (docs/PERF.md, eighth run). The plan's stage keeps t64x128:
            # its folded Q needs registers, and it was not timed on this tile.
            return TileConfig(warps=8, m_tiles=1, block_n=64, **wg)
        if role == "long":  # 128 keys per stage: half the steps, and wider wgmma (-8..-10 % against 64, 12-03)
            return TileConfig(warps=4, m_tiles=1, block_n=128, **wg)
        if role == "many_keys":  # 112 keys per stage, 75 KB, 3 CTAs per SM (Whisper prefill -6 %, 12-03)
            return TileConfig(warps=4, m_tiles=1, block_n=112, **wg)
        return TileConfig(warps=4, m_tiles=1, block_n=64, **wg)
    if role == "short":  # keys split between warps; deep pipeline, since decode only streams K/V
        if head_dim > 128:
            return TileConfig(warps=2, m_tiles=1, block_n=16, key_split=2, stages=2)
        if head_dim == 64:
            # swizzled stages of 192 keys, 2 CTAs per SM: fewer, wider steps. Against 4 stages of 64 keys in one
            # run (µs): Whisper decode 127.7 -> 123.5, at batch 16 48.1 -> 36.5 (docs/PERF.md, eleventh run)
            return TileConfig(warps=4, m_tiles=1, block_n=48, key_split=4, stages=2)
        return TileConfig(warps=4, m_tiles=1, block_n=16, key_split=4, stages=4 if head_dim <= 80 else 2)
    if role == "base":
        return TileConfig(warps=4, m_tiles=1, block_n=16 if head_dim > 128 else 64, key_split=1, stages=2)
    if role == "long":
        if head_dim <= 64:
            return TileConfig(warps=4, m_tiles=2, block_n=64, key_split=1, stages=2)
        if head_dim > 128:
            return tile_for("base", head_dim)
        return TileConfig(warps=8, m_tiles=1, block_n=32 if head_dim > 96 else 64, key_split=1, stages=2)
    if role == "few_keys":  # one stage per head; 8 warps of 16 rows (more warps per SM beat K/V reuse: 18-21 %)
        if head_dim > 128:
            return tile_for("base", head_dim)
        # sm_90, d = 40: stages filled by bulk copies of unpadded rows (see dense_rows_fit)
        tma = arch == 90 and dense_rows_fit(head_dim)
        return TileConfig(warps=8, m_tiles=1, block_n=FEW_KEYS, key_split=1, stages=2, one_tile=True, tma=tma)
    raise ValueError(f"fusednorm: unknown tile role {role!r}; expected one of {TILE_ROLES}")


@dataclass(frozen=True)
class KernelSpec:
    dtype: str              # "bf16" | "fp16": x, k, v, y
    head_dim: int
    norm: str               # "layer" | "rms"
    has_gamma: bool
    has_beta: bool
    affine_f32: bool        # gamma/beta stored as fp32 (else as dtype)
    mask: str               # "none" | "bool" (True = attend) | "add"
    mask_f32: bool          # additive mask stored as fp32 (else as dtype)
    tile: TileConfig
    arch: int               # 80, 86, 89, 90, ...
    check_numerics: bool
    q_from_qraw: bool = False  # projection plan: q from float32 x @ Wq'^T and the row stats (norm folded into Wq')
    write_o: bool = False      # projection plan: write o (no residual) for the out GEMM, plus its ones column

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"fusednorm: kernel dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"fusednorm: head dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"fusednorm: norm must be 'layer' or 'rms', got {self.norm!r}")
        if self.norm == "rms" and self.has_beta:
            raise ValueError("fusednorm: an RMS norm has no beta")
        if self.mask not in MASK_KINDS:
            raise ValueError(f"fusednorm: mask kind must be one of {MASK_KINDS}, got {self.mask!r}")
        t = self.tile
        if t.wgmma and not (self.arch == 90 and self.head_dim in WGMMA_HEAD_DIMS and t.m_tiles == 1
                            and t.key_split == 1 and t.warps % 4 == 0 and t.block_n <= 256):
            raise ValueError(f"fusednorm: tile {t.token} uses the warpgroup mma, which needs sm_90, head dim in "
                             f"{WGMMA_HEAD_DIMS}, one m-tile per warp, whole warpgroups and no key split")
        if t.tma and not (t.wgmma or (self.arch == 90 and dense_rows_fit(self.head_dim) and t.key_split == 1
                                      and not self.q_in_smem)):
            raise ValueError(f"fusednorm: tile {t.token} fills its stages by bulk tensor copies, which only the "
                             f"warpgroup-mma kernels and, on sm_90, head dims of an odd number of 16-byte chunks "
                             f"(d = 40) without a key split do")
        if t.producer and not (t.wgmma and t.tma and t.warps == 8 and self.head_dim == 64 and self.mask == "none"):
            raise ValueError(f"fusednorm: tile {t.token} is warp-specialised (templates/pnca/kernel_ws.cu), which "
                             f"takes sm_90 wgmma with bulk copies, 8 consumer warps, head dim 64 and no mask")
        # canonical forms, so that equal code means an equal key
        if self.q_from_qraw and (self.has_gamma or self.has_beta):  # folded into Wq': the kernel never reads them
            object.__setattr__(self, "has_gamma", False)
            object.__setattr__(self, "has_beta", False)
        if not (self.has_gamma or self.has_beta) and self.affine_f32:
            object.__setattr__(self, "affine_f32", False)
        if self.mask != "add" and self.mask_f32:
            object.__setattr__(self, "mask_f32", False)

    @property
    def q_in_smem(self) -> bool:
        """Q fragments stay in shared memory when holding them in registers would cost more than 32 per thread,
        or when two m-tiles per warp meet a mask (whose loads need the registers)."""
        q_regs = self.tile.m_tiles * ((self.head_dim + 15) // 16) * 4
        return q_regs > 32 or (self.tile.m_tiles > 1 and self.mask != "none")

    @property
    def min_ctas_per_sm(self) -> int:
        """__launch_bounds__ minimum: the memory-bound small-head base tile is worth the 3 CTAs per SM its shared
        memory allows (<= 168 registers), the few_keys tile with d <= 64 the 2 its shared memory allows (<= 128
        registers; in the plan's stage mode only without a mask: d = 40 with a bool mask would spill there), the
        sm_90 long tile with d <= 64 likewise 2 and its many_keys tile 3 (<= 168 registers); elsewhere the compiler
        may use what it needs."""
        t = self.tile
        if t.key_split == 1 and t.m_tiles == 1 and t.warps == 4 and t.block_n <= 64 and self.head_dim <= 64:
            return 3
        if (t.one_tile and t.warps == 8 and t.m_tiles == 1 and self.head_dim <= 64
                and (not self.q_from_qraw or self.mask == "none")):
            return 2
        if t.wgmma and t.warps == 4 and t.block_n == 128 and self.head_dim <= 64:  # the plan's sm_90 long: 82 KB
            return 2
        if t.wgmma and t.warps == 8 and t.block_n == 64 and self.head_dim <= 64 and not self.q_from_qraw:
            return 2  # sm_90 long: 68 KB and 128 registers allow 2
        if t.wgmma and t.warps == 4 and t.block_n == 112 and self.head_dim <= 64 and not self.q_from_qraw:
            return 3  # sm_90 many_keys: 75 KB allow 3 (without the fp32 norm parameters or mask), <= 168 registers
        return 1

    @property
    def grouped_stats(self) -> bool:
        """The row statistics may be summed in column groups and shared between the items of a row block
        (templates/pnca/statistics.cu; select.grouped_statistics decides per launch): the projection-free kernels
        whose warps hold one m-tile of their own rows, a head's keys in several stages. On an H100 this took T5's
        decoder from 41.0 to 38.2-38.7 us (docs/PERF.md, twenty-fourth run); the one-tile kernels spilled with it
        (for -1 % on SDXL 32x32) and the plan's stage lost 3 % (T5) to 5 % (SDXL 32x32), so they sum each row
        whole; so does the warp-specialised kernel, whose consumers may not hold a CTA barrier (the producer's
        warps never reach it)."""
        t = self.tile
        return not (t.one_tile or t.key_split > 1 or t.m_tiles > 1 or t.producer or self.q_from_qraw
                    or self.write_o)

    @property
    def kv_swizzled(self) -> bool:
        """K/V stages in the 128-byte-swizzle layout (unpadded rows; the XOR keeps ldmatrix free of bank
        conflicts): every wgmma tile (the layout it reads), and the key-split tiles whose head dim is whole
        64-column blocks and whose copies keep a thread's rows on one swizzle phase. 16 KB per 64-key stage
        instead of 18 is part of what lets the decode tile take 2 stages of 192 keys at 2 CTAs per SM."""
        t = self.tile
        copy_rows = t.threads // (self.head_dim // 8)
        return t.wgmma or (t.key_split > 1 and self.head_dim % 64 == 0 and copy_rows % 8 == 0)

    @property
    def rowsum_in_pv(self) -> bool:
        """The wgmma P V also sums each row of P (8 more columns of O read from a block of ones the size of a
        64-column V tile) instead of a separate row-sum wgmma: d = 64 only (V is one 64-column block, so the ones
        sit one block-step on), and only where that block leaves the CTAs per SM the tile is built for."""
        t = self.tile
        if not (t.wgmma and self.head_dim == 64):
            return False
        return self.min_ctas_per_sm * (self._smem_bytes(t.kv_rows * 128) + 1024) <= 228 * 1024

    @property
    def key(self) -> str:
        affine = ("g" if self.has_gamma else "") + ("b" if self.has_beta else "") or "noaff"
        if self.affine_f32:
            affine += "32"
        mask = {"none": "mnone", "bool": "mbool", "add": "madd32" if self.mask_f32 else "madd"}[self.mask]
        stage = ("_qf" if self.q_from_qraw else "") + ("_wo" if self.write_o else "")
        key = (f"pnca_{self.dtype}_d{self.head_dim}_{self.norm}_{affine}_{mask}{stage}_{self.tile.token}"
               f"_sm{self.arch}")
        return key + "_chk" if self.check_numerics else key

    def with_tile(self, tile: TileConfig) -> "KernelSpec":
        return replace(self, tile=tile)

    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA; mirrors the carve-up in templates/pnca/layout.cu."""
        t = self.tile
        ones = 0 if not t.wgmma else t.kv_rows * 128 if self.rowsum_in_pv else 1024  # the B of the row sums
        return self._smem_bytes(ones)

    def _smem_bytes(self, ones: int) -> int:
        t = self.tile
        pad = (self.head_dim + 15) // 16 * 16
        row_stride = pad + 8
        unpadded = self.kv_swizzled or t.tma
        kv = 2 * t.stages * t.kv_rows * (self.head_dim if unpadded else row_stride) * 2
        q = t.warps * t.rows_per_warp * row_stride * 2 if self.q_in_smem else 0
        x_slots = t.stages * t.block_m * (self.head_dim if t.tma else row_stride) * 2  # tma: unpadded
        # per-row mean and rstd; with a key split also the warps' partial sums and their merged m and l
        stats = t.warps * t.rows_per_warp * 2 * 4 + (2 * t.warps * 16 * 2 * 4 if t.key_split > 1 else 0)
        wide = self.q_from_qraw or self.affine_f32
        has_vecs = self.q_from_qraw or self.has_gamma or self.has_beta
        affine_slots = t.stages * 2 * self.head_dim * (4 if wide else 2) if has_vecs else 0
        barriers = t.stages * 8 if t.tma else 0
        if t.producer:  # full / empty per stage and x slot, then each consumer warp's affine slot (kernel_ws.cu;
            # one slot more: they start on a slot-size boundary past the barriers)
            barriers = 4 * t.stages * 8 + (t.warps + 1) * affine_slots // t.stages
        return kv + ones + q + x_slots + stats + affine_slots + barriers  # the key split merges in a stage


def supported_grid(archs=ARCHS):
    """Specs CI compiles: every (dtype, head dim, tile role, arch) with the heaviest options (LayerNorm with fp32
    gamma and beta, fp32 additive mask, numerics check), plus each lighter option value at least once per
    (dtype, head dim), and the projection plan's stage modes."""
    specs = {}
    for arch in archs:
        for dtype in DTYPES:
            for d in HEAD_DIMS:
                for role in TILE_ROLES:
                    s = KernelSpec(dtype, d, "layer", True, True, True, "add", True, tile_for(role, d, arch), arch,
                                   True)
                    specs[s.key] = s  # roles that share a tile (d = 256) share the kernel
                for ws in dict.fromkeys(tile_for(r, d, arch, warp_specialised=True)
                                        for r in ("many_keys", "many_keys_fine")):
                    for s in ((KernelSpec(dtype, d, "layer", True, True, True, "none", False, ws, arch, True),
                               KernelSpec(dtype, d, "rms", True, False, False, "none", False, ws, arch, False),
                               KernelSpec(dtype, d, "layer", False, False, False, "none", False, ws, arch, False),
                               # the plan's stage: folded Q in and o out, each alone
                               KernelSpec(dtype, d, "layer", False, False, False, "none", False, ws, arch, True,
                                          q_from_qraw=True, write_o=True),
                               KernelSpec(dtype, d, "rms", False, False, False, "none", False, ws, arch, False,
                                          q_from_qraw=True),
                               KernelSpec(dtype, d, "layer", True, True, False, "none", False, ws, arch, False,
                                          write_o=True))
                              if ws.producer else ()):  # the warp-specialised kernel takes no mask: each norm form
                        specs[s.key] = s
                base = tile_for("base", d, arch)
                for s in (KernelSpec(dtype, d, "rms", True, False, False, "bool", False, base, arch, False),
                          KernelSpec(dtype, d, "layer", False, False, False, "add", False, base, arch, False),
                          KernelSpec(dtype, d, "layer", True, True, False, "none", False, tile_for("short", d, arch),
                                     arch, False),
                          # the projection plan's attention stage (folded Q in, o out), LayerNorm and RMS
                          KernelSpec(dtype, d, "layer", False, False, False, "add", True,
                                     tile_for("long", d, arch, stage=True), arch, True, q_from_qraw=True, write_o=True),
                          # and its few_keys tile without a mask: the one stage kernel held to 2 CTAs per SM
                          KernelSpec(dtype, d, "layer", False, False, False, "none", False,
                                     tile_for("few_keys", d, arch, stage=True), arch, True, q_from_qraw=True,
                                     write_o=True),
                          KernelSpec(dtype, d, "rms", False, False, False, "bool", False, tile_for("short", d, arch),
                                     arch, False, q_from_qraw=True, write_o=True),
                          KernelSpec(dtype, d, "layer", True, True, False, "none", False, base, arch, False,
                                     write_o=True)):
                    specs[s.key] = s
    return list(specs.values())
