"""The projection plan's skinny GEMM (templates/skinny/gemm.cu): a few rows times a weight matrix, on sm_90.

    gemm_f32_out(a, w)      a @ w^T in float32              the plan's Q projection (qraw)
    gemm_add_into(y, a, w)  y += a @ w^T, rounded once       the plan's out projection (y holds the residual)

for a of at most 64 rows (a decode step's batch). cuBLAS takes ~5 µs for such a GEMM at any row count; this kernel
splits K between the 8 CTAs of a cluster and sums their partial tiles in a fixed order. ``why_not`` says when a
call is not for it (the plan then calls cuBLAS). One spec per (dtype, K, output form, arch), through the same
key -> render -> NVRTC -> disk cache -> load as the attention kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .render import TEMPLATE_DIR

MAX_ROWS = 64     # TILE_M in the template
TILE_N = 64       # columns per cluster
SPLITS = 8        # CTAs per cluster (the portable cluster size)
MAX_K = 4096      # two 64-row slices of K / 8 columns fit shared memory up to here
MIN_ARCH = 90     # thread-block clusters and distributed shared memory
THREADS = 128

enabled = True  # False: the plan's GEMMs always go to cuBLAS (benchmarks compare the two)
launches = 0    # skinny GEMMs launched by this process (tests tell them from the attention stage's launch)

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class SkinnySpec:
    dtype: str      # "bf16" or "fp16"
    k: int          # the exact K (a model dim: fixed for a model, unlike the row count)
    out_f32: bool   # True: out = a w^T in float32; False: out += a w^T in the element type
    arch: int = 90

    threads = THREADS
    cluster_size = SPLITS  # compile-time (__cluster_dims__): any launch of it forms these clusters

    @property
    def key(self) -> str:
        return f"skinny_{self.dtype}_k{self.k}_{'f32out' if self.out_f32 else 'addinto'}_sm{self.arch}"

    @property
    def k_slice(self) -> int:
        """K columns per CTA: K's 32-column blocks dealt evenly to the cluster's CTAs (the last ones may be short)."""
        return -(-(-(-self.k // 32)) // SPLITS) * 32

    @property
    def row_bytes(self) -> int:
        """A slice row in shared memory: padded to 64 bytes past a multiple of 128, so that the two rows of a
        16-byte read's quarter-warp fall on different banks."""
        b = self.k_slice * 2
        return b + (64 - b % 128) % 128

    def smem_bytes(self) -> int:
        return 2 * MAX_ROWS * self.row_bytes + MAX_ROWS * (TILE_N + 8) * 4  # a and w slices, the partial tile

    def source(self) -> str:
        constants = {"ELEM_IS_BF16": self.dtype == "bf16", "K_LEN": self.k, "K_SLICE": self.k_slice,
                     "ROW_BYTES": self.row_bytes, "OUT_F32": self.out_f32, "SMEM_BYTES": self.smem_bytes()}
        lines = [f"// fusednorm generated kernel {self.key}", "// configuration (fusednorm/codegen/skinny.py)"]
        for name, value in constants.items():
            lines.append(f"constexpr {'bool' if isinstance(value, bool) else 'int'} {name} = "
                         f"{str(value).lower() if isinstance(value, bool) else value};")
        lines.append(f"#define KERNEL_NAME {self.key}")
        return "\n\n".join(["\n".join(lines), _template("prelude.cu"), _template("skinny/gemm.cu")])


@lru_cache(maxsize=None)
def _template(name: str) -> str:
    return (TEMPLATE_DIR / name).read_text()


def why_not(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    """None when ``out (=|+=) a @ w^T`` runs here, else why not (the caller then uses cuBLAS); ``out`` None: the
    float32 output that gemm_f32_out makes."""
    if not enabled:
        return "switched off (skinny.enabled)"
    if a.device.type != "cuda":
        return "not on CUDA"
    from . import _device_capability

    major, minor = _device_capability(a.device.index if a.device.index is not None else torch.cuda.current_device())
    if major * 10 + minor < MIN_ARCH:
        return f"needs sm_{MIN_ARCH} (thread-block clusters)"
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        return f"operands {a.dtype}/{w.dtype}, not one 16-bit float type"
    (m, k), (n, kw) = a.shape, w.shape
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows, more than {MAX_ROWS}"
    if kw != k or k % 8 or k > MAX_K or n % 8:
        return f"K {k} / N {n}: K must be a multiple of 8 up to {MAX_K} and N of 8"
    for name, t in (("a", a), ("w", w), ("out", out)):
        if t is not None and (t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16):
            return f"{name} is not row-major with 16-byte aligned rows"
    return None


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, out_f32: bool, w_before_wait: bool) -> None:
    from . import _device_capability, launch
    from .cache import get_kernel

    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    major, minor = _device_capability(device)
    spec = SkinnySpec(_DTYPES[a.dtype], a.shape[1], out_f32, major * 10 + minor)
    kernel = launch.load(get_kernel(spec), device)
    grid = -(-w.shape[0] // TILE_N) * SPLITS
    pointers = (a.data_ptr(), w.data_ptr(), out.data_ptr()) + (0,) * (launch.POINTERS - 3)
    tail = ((a.stride(0), w.stride(0), out.stride(0)) + (0,) * 8 + (a.shape[0], w.shape[0], int(w_before_wait))
            + (0,) * 12 + (0.0, 0.0))
    launch.launch(kernel, grid, torch.cuda.current_stream(device).cuda_stream, pointers, tail)
    global launches
    launches += 1


def gemm_f32_out(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w^T in float32 (a: [M, K], w: [N, K]); why_not must have returned None for the output it makes."""
    from . import poison_outputs

    out = torch.empty(a.shape[0], w.shape[0], device=a.device, dtype=torch.float32)
    if poison_outputs:
        out.fill_(float("nan"))
    _launch(a, w, out, True, False)
    return out


def gemm_add_into(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor, w_before_wait: bool = False) -> torch.Tensor:
    """y += a @ w^T (y: [M, N] in a's type), each element rounded once, as addmm with beta = 1 rounds it.
    ``w_before_wait``: the kernel just before this one in the stream does not write w, so w is loaded while that
    kernel still runs (the plan's out projection after its attention stage)."""
    _launch(a, w, y, False, w_before_wait)
    return y
