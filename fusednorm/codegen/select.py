"""Run-time choice among a spec's few compiled tile configurations, and the persistent grid for one call.

Nothing here compiles: every role of a spec family is compiled together the first time the family is met, so a
new B, Lq or Lk only changes this choice. ``force_role`` pins the role (benchmarks compare the roles with it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .spec import FEW_KEYS, FINE_KEYS, MANY_KEYS, TileConfig

force_role: str | None = None  # one of spec.TILE_ROLES, or None (automatic)


def tile_role(q_len: int, kv_len: int, batch: int = 1, heads: int = 1, sm_count: int = 132,
              stage: bool = False, few_keys: bool = True, many_keys_ws: bool = False) -> str:
    """Which tile configuration suits these lengths.

    "long" (128 query rows per CTA, two m-tiles per warp) reuses each K/V fragment twice and halves the per-row
    cost of every stage and barrier. It measured faster for long key lengths (tensor-core bound) and wherever its
    items still fill the GPU several times over (seed, SD 1.5: 10-25 %); with few items (SDXL 64x64:
    2 * 32 row blocks * 10 heads, Lk 77) the 64-row "base" tile wins by spreading the work wider.
    Up to FEW_KEYS keys, "few_keys" (one stage per head, 8 warps of 16 rows) beat both on every such shape. In the
    projection plan's attention stage (``stage``: folded Q in) it wins where it runs 2 CTAs per SM (``few_keys``:
    the caller knows its occupancy) and its 128-row items fill the GPU 4 times over (plan, H100 12-05: SD 1.5 -13 %,
    SDXL 64x64 -9.5 %, seed -5 %; SDXL 32x32, 2.4 times over, +5 %), and nowhere else.
    From MANY_KEYS keys on, "many_keys" (on sm_90 with d = 64: 112 keys per stage, 3 CTAs per SM) beat the long
    tile at Lk 1500 (Whisper prefill -6.5 %, and -1.5 % with 4x the query rows) but lost wherever Lk is a multiple
    of the long tile's 128 keys (Lk 512: +12 %, Lk 2048: +9 and +10 %; 2026-12-03): those keep the long tile.
    Why 1500 favours the third CTA is not established; other lengths were not measured. The stage keeps the long
    tile there, whose registers the folded Q needs. ``many_keys_ws``: the family's many_keys tile is the
    warp-specialised one (sm_90, d = 64, no mask: spec.tile_for), which takes every Lk from MANY_KEYS on, in the
    stage too (its consumers have the registers: Whisper prefill's plan 274.8 against 323.0 us with the long tile,
    H100, docs/PERF.md fortieth run), with stages of FINE_KEYS keys ("many_keys_fine") wherever those pad Lk no
    further than 128-key stages (Whisper prefill -4.6 %; Lk 2048, which they would pad by 64 keys, +3 %:
    docs/PERF.md, thirty-eighth run).
    """
    if force_role is not None:  # few_keys cannot take more keys than its one stage holds
        return "base" if force_role == "few_keys" and kv_len > FEW_KEYS else force_role
    if q_len <= 16:
        return "short"  # too few query rows to fill warps: split the keys between warps instead
    items_128 = batch * _cdiv(q_len, 128) * heads
    if few_keys and kv_len <= FEW_KEYS and (not stage or items_128 >= 4 * sm_count):
        return "few_keys"  # one stage per head: nothing carried between key tiles (seed -20 %, SD 1.5 -21 %)
    if q_len >= 128 and (kv_len >= 256 or items_128 >= 8 * sm_count):
        # from MANY_KEYS keys on, unless the long tile's 128-key stages hold them exactly
        many = kv_len >= MANY_KEYS and (kv_len % 128 != 0 or many_keys_ws)
        if not many or (stage and not many_keys_ws):
            return "long"
        fine = many_keys_ws and _cdiv(kv_len, FINE_KEYS) * FINE_KEYS <= _cdiv(kv_len, 128) * 128
        return "many_keys_fine" if fine else "many_keys"
    return "base"


force_heads_per_item: int | None = None  # pins G (benchmarks compare the splits with it)
force_kv_chunks: int | None = None  # pins the runs of keys per head of the key-split tiles (benchmarks, as above)
force_stat_col_groups: int | None = None  # pins the statistics' column groups (1: each row whole; as above)


@dataclass(frozen=True)
class LaunchPlan:
    role: str
    heads_per_item: int
    head_groups: int
    row_blocks: int
    items: int
    grid: int
    kv_chunks: int = 1     # key-split tiles: runs of key tiles per (batch, row block, head), one item each
    chunk_tiles: int = 0   # key tiles per run (all of them when kv_chunks is 1)
    stat_col_groups: int = 1  # > 1: the row statistics summed in that many column groups (see grouped_statistics)
    share_stats: bool = False  # and each item sums its own group, taking the others' from the other items


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_launch(role: str, tile: TileConfig, batch: int, q_len: int, kv_len: int, heads: int, head_dim: int,
                sm_count: int, ctas_per_sm: int, device_sms: int | None = None,
                model_dim: int | None = None, grouped_stats: bool = False) -> LaunchPlan:
    """Pick G (heads per work item), for key-split tiles the runs of keys per head, and the persistent grid.

    A work item is (batch, block of query rows, group of G heads). Larger G reads each x row fewer times for the
    statistics; smaller G makes more items when B * row_blocks alone cannot fill the GPU (decode). The cost model
    counts waves of items over the SMs, each item costing G heads of work plus one statistics pass over D.
    ``device_sms`` (default ``sm_count``): the device's SMs, which alone decide the runs of keys and the statistics'
    column groups, so that results stay bit-identical whatever ``sm_count`` bounds (see key_chunks,
    grouped_statistics). ``model_dim``: the columns of x the statistics sum (default heads * head_dim).
    ``grouped_stats``: the kernel can sum them in column groups (KernelSpec.grouped_stats).
    """
    row_blocks = _cdiv(q_len, tile.block_m)
    key_tiles = _cdiv(kv_len, tile.kv_rows)
    chunks, chunk_tiles = 1, key_tiles
    if tile.key_split > 1:
        chunks, chunk_tiles = key_chunks(batch * row_blocks * heads, key_tiles, device_sms or sm_count)
        if force_kv_chunks is not None:
            chunk_tiles = _cdiv(key_tiles, max(1, min(force_kv_chunks, key_tiles)))
            chunks = _cdiv(key_tiles, chunk_tiles)
    slots = sm_count * min(ctas_per_sm, 2)  # beyond ~2 CTAs per SM, extra CTAs mostly share the same bandwidth
    head_cost = head_dim * (2.0 + kv_len / 16.0)
    stats_cost = float(heads * head_dim)
    best = None
    for g in range(1, heads + 1):
        groups = _cdiv(heads, g)
        if chunks > 1 and g > 1:
            break  # keys split between CTAs: one head per item (there are too few items already)
        if force_heads_per_item is not None and chunks == 1:
            if g != min(force_heads_per_item, heads):
                continue
        elif g > 1 and _cdiv(heads, g - 1) == groups:
            continue  # same number of groups as a smaller G: keep the most even split
        items = batch * row_blocks * groups
        cost = _cdiv(items, slots) * (g * head_cost + stats_cost)
        if best is None or cost < best[0] or (cost == best[0] and g > best[1]):
            best = (cost, g, groups, items)
    _, g, groups, items = best
    items *= chunks
    grid = min(items, sm_count * ctas_per_sm)
    plan = LaunchPlan(role, g, groups, row_blocks, items, grid, chunks, chunk_tiles)
    if not grouped_stats:
        return plan
    full = plan  # the statistics' groups follow the whole device
    if device_sms is not None and device_sms != sm_count:
        full = plan_launch(role, tile, batch, q_len, kv_len, heads, head_dim, device_sms, ctas_per_sm)
    col_groups = grouped_statistics(full, model_dim or heads * head_dim)
    if force_stat_col_groups is not None:
        col_groups = max(1, force_stat_col_groups)
    share = col_groups > 1 and groups == col_groups and items <= grid
    return replace(plan, stat_col_groups=col_groups, share_stats=share)


GROUPED_STATS_MIN_DIM = 768  # below, a row's statistics take <= 5 round trips, and sharing them measured level


def grouped_statistics(full: LaunchPlan, model_dim: int) -> int:
    """Column groups of the row statistics (templates/pnca/statistics.cu), for a kernel that can group them: the
    head groups, where a block of rows is split between several items that the whole device runs in one wave, else
    1 (one pass per row). Each item then sums only its group's share of every row's columns and takes the rest from
    the other items: T5's decoder (D = 1024, 8 items per 128 rows) -6 to -8 % on an H100 (docs/PERF.md,
    twenty-fourth run). It follows the plan for the whole device, never sm_count, so that results stay
    bit-identical whatever sm_count bounds (the sums' order is the groups'); a bounded grid sums every group in each
    item instead."""
    if full.kv_chunks > 1 or model_dim < GROUPED_STATS_MIN_DIM:
        return 1
    return full.head_groups if full.head_groups > 1 and full.items <= full.grid else 1


def key_chunks(pairs: int, key_tiles: int, slots: int) -> tuple[int, int]:
    """(runs, key tiles per run) for ``pairs`` (batch, row block, head) pairs of ``key_tiles`` key tiles each.

    Flash-decoding's split: when the pairs cannot fill the device's SMs, each pair's keys are split into runs
    handled by separate CTAs and merged by the last (a run writes and the merge reads its partial state: counted as
    one more key tile). The cost is waves of items over ``slots`` (one CTA per SM: a second CTA on an SM adds
    little to a stream of K/V that one already draws) times the tiles each item streams; the fewest runs win a tie.
    Every run is non-empty: runs = ceil(key_tiles / tiles per run). On an H100 (docs/PERF.md) with 8 key tiles
    this picks 4 runs for 20 pairs, 8 for 8 pairs and none for 80 or more, where splitting was slower.
    """
    best = (_cdiv(pairs, slots) * key_tiles, 1, key_tiles)
    for tiles in range(key_tiles - 1, 0, -1):
        runs = _cdiv(key_tiles, tiles)
        cost = _cdiv(pairs * runs, slots) * (tiles + 1)
        if cost < best[0]:
            best = (cost, runs, tiles)
    return best[1], best[2]
