"""Generated CUDA kernels for the fused op: spec -> render -> NVRTC -> disk cache -> launch.

The projection-free op is one launch of ``run_kernel``; the projection plan (fusednorm/plans) runs the same
kernel in its stage mode, described by a ``StageIO``.

``why_no_kernel`` says (from shapes, dtypes, strides and device alone, so FakeTensors work) whether a kernel
covers a call; ``run_kernel`` runs it. Float32/float64 inputs, head dims outside ``spec.HEAD_DIMS`` and GPUs older
than sm_80 get a reason, and the dispatcher runs the reference implementation instead.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import graph_memory as _graph_memory
from . import cache as _cache
from . import launch as _launch
from . import select as _select
from . import tensormap as _tensormap
from .cache import get_kernel
from .spec import HEAD_DIMS, TILE_ROLES, KernelSpec, tile_for

__all__ = ["why_no_kernel", "run_kernel", "StageIO", "call_key", "call_plans", "launch_call",
           "forget_loaded_kernels"]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_INT32_MAX = 2**31 - 1

# Debug setting for tests: fill the output with NaN before each launch, so that an unwritten element shows.
poison_outputs = False

_capability: dict[int, tuple[int, int]] = {}


def _device_capability(index: int) -> tuple[int, int]:
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    return cap


def why_no_kernel(x, k, v, gamma, beta, mask, norm) -> str | None:
    """None when a generated kernel runs these inputs, else the reason in words."""
    if x.device.type != "cuda":
        return f"x is on {x.device}, not on a CUDA device"
    if x.dtype not in _KERNEL_DTYPES:
        return f"generated kernels cover float16 and bfloat16, not {x.dtype}"
    if norm not in ("layer", "rms"):
        return f"unknown norm kind {norm!r}"
    B, Lq, D = x.shape
    _, H, Lk, d = k.shape
    if d not in HEAD_DIMS:
        return f"head dim {d} is not one of the generated head dims {HEAD_DIMS}"
    if min(B, Lq, Lk, H) == 0:
        return "an input is empty"
    if max(B * Lq * H, Lq, Lk, D) > _INT32_MAX:
        return "sizes past the kernel's 32-bit counters"
    for name, t in (("gamma", gamma), ("beta", beta)):
        if t is not None and not t.dtype.is_floating_point:
            return f"{name} is not floating point"
    if mask is not None and not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        return f"mask dtype {mask.dtype} is neither bool nor floating"
    index = x.device.index
    if index in _capability or torch.cuda.is_available():
        if index is None:
            index = torch.cuda.current_device()
        major, minor = _device_capability(index)
        if major < 8:
            return f"the GPU is sm_{major}{minor}; generated kernels need sm_80 or newer (bf16 mma, cp.async)"
    return None


# ---- kernel families: all tile roles of one spec, compiled together the first time they are needed ----

_families: dict[tuple, dict[str, "_launch.LoadedKernel"]] = {}
_family_lock = threading.Lock()


def _family(dtype: str, d: int, norm: str, has_gamma: bool, has_beta: bool, affine_f32: bool, mask_kind: str,
            mask_f32: bool, arch: int, check: bool, device_index: int, q_from_qraw: bool = False,
            write_o: bool = False):
    fkey = (dtype, d, norm, has_gamma, has_beta, affine_f32, mask_kind, mask_f32, arch, check, device_index,
            q_from_qraw, write_o)
    fam = _families.get(fkey)
    if fam is not None:
        return fam
    with _family_lock:
        fam = _families.get(fkey)
        if fam is None:
            no_mask = mask_kind == "none"  # what kernel_ws.cu takes
            specs = {role: KernelSpec(dtype, d, norm, has_gamma, has_beta, affine_f32, mask_kind, mask_f32,
                                      tile_for(role, d, arch, stage=q_from_qraw, warp_specialised=no_mask),
                                      arch, check, q_from_qraw, write_o)
                     for role in TILE_ROLES}
            with ThreadPoolExecutor(len(specs)) as pool:
                compiled = dict(zip(specs, pool.map(get_kernel, specs.values())))
            fam = {role: _launch.load(compiled[role], device_index) for role in specs}
            _families[fkey] = fam
    return fam


def forget_loaded_kernels() -> None:
    """Drop the loaded kernel families, launch plans, cached calls and compiled kernels held in memory (not the disk
    cache), so that the next call builds them again: for tests and benchmarks that change what a family is made of
    (``tile_for``, the occupancy bound, the rendered source) without changing its keys."""
    _cache.clear_memory_cache()
    _families.clear()
    _plans.clear()
    call_plans.clear()


# ---- per-call preparation ----

_flags: dict[int, torch.Tensor] = {}
_plans: dict[tuple, "_select.LaunchPlan"] = {}
_sm_counts: dict[int, int] = {}


def _fast_operand(t: torch.Tensor, what: str, tensor_map: bool) -> torch.Tensor:
    """k/v as the kernel reads them: last dim contiguous, 16-byte aligned rows, and for a kernel whose stages are
    bulk copies a layout a tensor map describes. Otherwise a contiguous copy."""
    s = t.stride()
    if not (s[3] == 1 and s[0] % 8 == 0 and s[1] % 8 == 0 and s[2] % 8 == 0 and t.data_ptr() % 16 == 0):
        reason = "is not laid out for 16-byte loads"
    elif tensor_map and not _tensormap.describable(t.data_ptr(), *_kv_map_dims(t)):
        reason = "has a layout no tensor map describes (a key dim of stride 0?)"
    else:
        return t
    from ..warn import warn_once

    warn_once(f"fusednorm: {what} {reason} (strides {tuple(s)}); copying it to a contiguous tensor on every call")
    return t.clone(memory_format=torch.contiguous_format)  # not .contiguous(): a no-op on a misaligned contiguous t


def _param_vector(t: torch.Tensor | None, x_dtype: torch.dtype):
    """gamma/beta as the kernel reads them: x's dtype or fp32, contiguous, 16-byte aligned."""
    if t is None:
        return None
    if t.dtype not in (x_dtype, torch.float32):
        t = t.float()
    if not t.is_contiguous() or t.data_ptr() % 16 != 0:
        t = t.contiguous().clone()
    return t


def _prepare_mask(mask: torch.Tensor, x_dtype, B: int, H: int, Lq: int, Lk: int):
    """(tensor, kind, is_f32, (s_b, s_h, s_q)) with keys contiguous and size-1 dims broadcast through stride 0."""
    if mask.dtype == torch.bool:
        kind, is_f32 = "bool", False
    else:
        kind = "add"
        if mask.dtype not in (x_dtype, torch.float32):
            mask = mask.float()
        is_f32 = mask.dtype == torch.float32
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[-1] != Lk or (mask.stride(-1) != 1 and Lk > 1):
        mask = mask.expand(*mask.shape[:-1], Lk).contiguous()
    strides = tuple(0 if mask.shape[i] == 1 else mask.stride(i) for i in range(3))
    return mask, kind, is_f32, strides


@dataclass
class StageIO:
    """The projection plan's attention stage (plans/__init__.py). All defaults: the projection-free op."""
    qraw: torch.Tensor | None = None  # [B * Lq, H * d] float32, x @ Wq'^T: queries come from it, not from norm(x)
    q_u: torch.Tensor | None = None   # [H * d] float32, Wq' @ 1 (LayerNorm)
    q_b: torch.Tensor | None = None   # [H * d] float32, Wq @ beta + bq
    o_cols: int = 0                   # > 0: return o as [B, Lq, o_cols] (no residual); past H * d, a ones column
    x_copy: torch.Tensor | None = None  # with o_cols: [B * Lq, D], contiguous, receives a copy of x (the out GEMM's C)


def run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, call_key=None, stage=None):
    """y = x + MHA(norm(x) split into heads, k, v) with the generated kernel (inputs already validated), or with
    ``stage`` the plan's attention stage.

    With ``call_key`` (see ``call_key``; for the plan's stage, a key that also covers the projections' shapes, which
    fix qraw's and o's layout), a call whose tensors the kernel reads as given, with no copy or conversion, leaves
    its launch in ``call_plans`` so that the next call with that key can go straight to it.
    """
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if device_index != torch.cuda.current_device():
        with torch.cuda.device(device_index):  # not cached: a cached launch has no device switch
            return run_kernel(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics, stage=stage)
    given = (x, k, v, gamma, beta)
    mask_ptr = mask.data_ptr() if mask is not None else 0
    B, Lq, D = x.shape
    _, H, Lk, d = k.shape
    if not x.is_contiguous() or x.data_ptr() % 16 != 0:
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    gamma = _param_vector(gamma, x.dtype)
    beta = _param_vector(beta, x.dtype)
    affine = gamma if gamma is not None else beta
    affine_f32 = affine is not None and affine.dtype == torch.float32
    if gamma is not None and beta is not None and gamma.dtype != beta.dtype:
        gamma, beta, affine_f32 = gamma.float(), beta.float(), True
    if mask is not None:
        mask, mask_kind, mask_f32, m_strides = _prepare_mask(mask, x.dtype, B, H, Lq, Lk)
    else:
        mask_kind, mask_f32, m_strides = "none", False, (0, 0, 0)

    major, minor = _device_capability(device_index)
    stage = stage or StageIO()
    fam = _family(_KERNEL_DTYPES[x.dtype], d, norm, gamma is not None, beta is not None, affine_f32, mask_kind,
                  mask_f32, major * 10 + minor, bool(check_numerics), device_index, stage.qraw is not None,
                  stage.o_cols > 0)

    device_sms = _sm_counts.get(device_index)
    if device_sms is None:
        device_sms = _sm_counts[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    sms = device_sms if sm_count is None else max(1, min(int(sm_count), device_sms))
    # the tile choice follows the device, never sm_count: results stay bit-identical whatever sm_count bounds
    folded_q = stage.qraw is not None  # the stage's few_keys kernel, only where it runs 2 CTAs per SM
    role = _select.tile_role(Lq, Lk, B, H, device_sms, stage=folded_q,
                             few_keys=not folded_q or fam["few_keys"].ctas_per_sm >= 2,
                             many_keys_ws=fam["many_keys"].spec.tile.producer)
    kernel = fam[role]
    if kernel.spec.tile.one_tile and Lk > kernel.spec.tile.block_n:  # the kernel would drop keys: never launch it
        raise RuntimeError(f"fusednorm: internal error: {kernel.spec.key} takes at most "
                           f"{kernel.spec.tile.block_n} keys, got Lk = {Lk}")
    k = _fast_operand(k, "k", kernel.spec.tile.tma)
    v = _fast_operand(v, "v", kernel.spec.tile.tma)
    pkey = (role, id(kernel), B, Lq, Lk, H, D, sms, _select.force_heads_per_item, _select.force_kv_chunks,
            _select.force_stat_col_groups)
    plan = _plans.get(pkey)
    if plan is None:
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[pkey] = _select.plan_launch(role, kernel.spec.tile, B, Lq, Lk, H, d, sms, kernel.ctas_per_sm,
                                                  device_sms=device_sms, model_dim=D,
                                                  grouped_stats=kernel.spec.grouped_stats)

    ks, vs = k.stride(), v.stride()
    out_cols = stage.o_cols or D
    if plan.kv_chunks > 1:  # a ticket per (batch, row block, head) pair split by keys, and the chunks' states
        tickets = B * plan.row_blocks * H
        part_floats = tickets * plan.kv_chunks * 16 * (d + 4)
    elif plan.share_stats:  # two counters per (batch, row block), and the column groups' sums of every row
        tickets = B * plan.row_blocks * 2
        part_floats = plan.stat_col_groups * B * Lq * 2
    else:
        tickets = part_floats = 0
    call = CallPlan(kernel, plan.grid, bool(check_numerics), (
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], m_strides[0], m_strides[1], m_strides[2],
        stage.qraw.stride(0) if stage.qraw is not None else 0, out_cols,
        B, Lq, Lk, H, D, plan.heads_per_item, plan.head_groups, plan.row_blocks, plan.items,
        int(stage.o_cols > H * d), plan.stat_col_groups, int(plan.share_stats), plan.kv_chunks, plan.chunk_tiles,
        float(eps), _scale_log2(scale, d)), out_cols, tickets, part_floats)
    y = launch_call(call, x, k, v, gamma, beta, mask, stage)
    # A hit hands the caller's tensors to the kernel unprepared, so only a call that needed no copy or conversion
    # is cached (a mask view keeps its pointer; a copy cannot share it while the caller's mask is alive).
    if (call_key is not None and all(a is b for a, b in zip((x, k, v, gamma, beta), given))
            and (mask is None or mask.data_ptr() == mask_ptr)):
        if len(call_plans) >= _CALL_PLANS_MAX:
            call_plans.clear()
        call_plans[call_key] = call
    return y


def _scale_log2(scale: float | None, head_dim: int) -> float:
    """The softmax scale (1 / sqrt(d) when None) in log2 units, as the kernel's exponent uses it."""
    return (head_dim ** -0.5 if scale is None else float(scale)) * 1.4426950408889634


# ---- the per-call signature cache: eager calls shaped like an earlier one skip the checks and the planning ----

@dataclass(frozen=True)
class CallPlan:
    """One launch minus its pointers: what every call with the same ``call_key`` launches."""
    kernel: "_launch.LoadedKernel"
    grid: int
    check_numerics: bool
    tail: tuple  # Params after its pointers: strides, sizes, work split, eps, scale
    out_cols: int  # columns of the output rows: D, or the stage's o_cols
    tickets: int = 0  # Params.tickets: keys split between CTAs, or statistics shared between them; else 0
    part_floats: int = 0  # and the floats of Params.part: the chunks' partial states, or the shared sums
    # tma tiles: TmaMaps by (x, k, v, y) pointers. The call key fixes every other input of the maps (shapes,
    # strides, the tile), so the pointers alone find them: one small tuple per call instead of shapes and strides
    maps: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


call_plans: dict[tuple, CallPlan] = {}
_CALL_PLANS_MAX = 4096  # a model meets a handful of signatures; the bound only stops unbounded growth


def call_key(x, k, v, gamma, beta, mask, norm, eps, scale, sm_count, check_numerics) -> tuple:
    """Everything ``check_inputs``, ``why_no_kernel`` and ``run_kernel`` read from a call, pointers aside.

    Two calls with equal keys pass or fail the same checks, get the same kernel and grid, and need the same
    copies; a setting that changes any of these (``select.force_role``) belongs in the key too. Alignment is
    the one fact about a pointer that matters, so it is kept as a bool.
    """
    return (
        x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0,
        k.shape, k.stride(), k.dtype, k.device, k.data_ptr() % 16 == 0,
        v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16 == 0,
        None if gamma is None else (gamma.shape, gamma.stride(), gamma.dtype, gamma.device,
                                    gamma.data_ptr() % 16 == 0),
        None if beta is None else (beta.shape, beta.stride(), beta.dtype, beta.device, beta.data_ptr() % 16 == 0),
        None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device, mask.data_ptr() % 16 == 0),
        norm, eps, scale, sm_count, check_numerics, _current_device(), _select.force_role,
        _select.force_heads_per_item, _select.force_kv_chunks, _select.force_stat_col_groups,
    )


# torch's current device without torch.cuda.current_device()'s lazy-init check (a CUDA tensor's call: initialised)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
# torch's current stream as a raw cudaStream_t; the private getter skips building a torch.cuda.Stream per call
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device_index: torch.cuda.current_stream(device_index).cuda_stream)


def launch_call(call: CallPlan, x, k, v, gamma, beta, mask, stage: StageIO | None = None) -> torch.Tensor:
    """Allocate y (or the stage's o) and launch ``call`` on these tensors, laid out as the kernel reads them."""
    B, Lq, D = x.shape
    if call.out_cols == D:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        y = torch.empty((B, Lq, call.out_cols), dtype=x.dtype, device=x.device)
    if poison_outputs:
        y.fill_(float("nan"))
    device_index = call.kernel.device_index
    flag = None
    if call.check_numerics:
        flag = _flags.get(device_index)
        if flag is None and _graph_memory.capturing(x):
            flag = torch.zeros(1, dtype=torch.int32, device=x.device)  # the capture's own (a graph pool's memory)
        elif flag is None:
            flag = _flags[device_index] = _graph_memory.kept_copies([torch.zeros(1, dtype=torch.int32,
                                                                                 device=x.device)])[0]
    stream = _raw_stream(device_index)
    part = tickets = None
    if call.tickets:
        part = torch.empty(call.part_floats, dtype=torch.float32, device=x.device)
        tickets = _zeroed_tickets(call.tickets, x, device_index, stream)
    xp, yp, kp, vp = x.data_ptr(), y.data_ptr(), k.data_ptr(), v.data_ptr()
    pointers = (xp, yp, kp, vp,
                gamma.data_ptr() if gamma is not None else 0, beta.data_ptr() if beta is not None else 0,
                mask.data_ptr() if mask is not None else 0, flag.data_ptr() if flag is not None else 0,
                *_stage_pointers(stage), part.data_ptr() if part is not None else 0,
                tickets.data_ptr() if tickets is not None else 0)
    maps = b""
    if call.kernel.spec.tile.tma:
        maps = call.maps.get((xp, kp, vp, yp))
        if maps is None:
            if len(call.maps) >= _MAPS_PER_CALL:
                call.maps.clear()
            maps = call.maps[xp, kp, vp, yp] = _tma_maps(call.kernel.spec.tile, x, k, v, y)
    _launch.launch(call.kernel, call.grid, stream, pointers, call.tail, maps)
    if flag is not None:
        _raise_if_flagged(flag, call.kernel.spec.key)
    return y


# Params.tickets must be zero when a kernel starts, and every kernel leaves them zero. Outside CUDA graphs one buffer
# per (device, stream) serves every launch, since launches on one stream run one after another: no memset per call.
# A launch on another stream may run at the same time, so it gets its own; a graph being captured gets zeroed words
# of its own (a memset node), since its replays may run beside anything.
_tickets: dict[tuple[int, int], torch.Tensor] = {}


def _zeroed_tickets(n: int, x: torch.Tensor, device_index: int, stream: int) -> torch.Tensor:
    if _graph_memory.capturing(x):
        return torch.zeros(n, dtype=torch.int32, device=x.device)
    words = _tickets.get((device_index, stream))
    if words is None or words.numel() < n:
        words = _tickets[device_index, stream] = _graph_memory.kept_copies(
            [torch.zeros(max(n, 4096), dtype=torch.int32, device=x.device)])[0]
    return words


def _kv_map_dims(t: torch.Tensor) -> tuple[tuple, tuple]:
    """k or v [B, H, Lk, d] as a tensor map sees it, innermost first; a head or batch dim broadcast with stride 0
    has size 1 there (the kernel then keeps its coordinate at 0: see load_step_tma)."""
    B, H, Lk, d = t.shape
    s = t.stride()
    return (d, Lk, H if s[1] else 1, B if s[0] else 1), (1, s[2], s[1], s[0])


_MAPS_PER_CALL = 64  # pointer sets kept per cached call (a model's activations sit at a few addresses)


def _tma_maps(tile, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor) -> bytes:
    """TmaMaps for a tile whose stages are bulk copies: x (contiguous) as [B, Lq, D] in boxes of w columns by the
    tile's rows, k and v as strided [B, H, Lk, d] in boxes of w columns by a stage's keys, y (contiguous, D or the
    stage's o columns) in boxes of w columns by a warp's rows (dims innermost first); w = 64 swizzled for the
    wgmma tiles, else the head dim unpadded (templates/pnca/layout.cu: DENSE_ROWS). Each map stays in tensormap's own
    cache, so a call whose pointers are new encodes only the maps whose tensor moved."""
    B, Lq, D = x.shape
    cols = y.shape[2]
    w, swizzle = (64, True) if tile.wgmma else (k.shape[3], False)
    kv_box = (w, tile.kv_rows, 1, 1)
    maps = (_tensormap.tile_map(x.data_ptr(), (D, Lq, B), (1, D, Lq * D), (w, tile.block_m, 1), swizzle)
            + _tensormap.tile_map(k.data_ptr(), *_kv_map_dims(k), kv_box, swizzle)
            + _tensormap.tile_map(v.data_ptr(), *_kv_map_dims(v), kv_box, swizzle)
            + _tensormap.tile_map(y.data_ptr(), (cols, Lq, B), (1, cols, Lq * cols), (w, tile.rows_per_warp, 1),
                                  swizzle))
    return maps


def _stage_pointers(stage: StageIO | None) -> tuple:
    if stage is None:
        return 0, 0, 0, 0
    x_copy = stage.x_copy.data_ptr() if stage.x_copy is not None and stage.o_cols else 0
    if stage.qraw is None:
        return 0, 0, 0, x_copy
    return (stage.qraw.data_ptr(), stage.q_u.data_ptr() if stage.q_u is not None else 0,
            stage.q_b.data_ptr(), x_copy)


def _raise_if_flagged(flag: torch.Tensor, key: str) -> None:
    from ..numerics import numerics_error, skipped_while_capturing

    if skipped_while_capturing(flag):
        return
    if int(flag.item()) != 0:  # .item() waits for the stream
        flag.zero_()
        raise numerics_error(f"generated kernel {key}")
