"""Load cubins into torch's CUDA context (once per kernel key and device) and launch them with the driver API on
torch's current stream. The per-call path is kept thin: one struct pack into a per-thread buffer, one
cuLaunchKernel (cuLaunchKernelEx for sm_90 kernels: a programmatic launch, see programmatic_launch)."""
from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
from dataclasses import dataclass

import torch

from .cache import CompiledKernel
from .spec import KernelSpec

# The kernel's first argument, ``struct Params`` in templates/pnca/layout.cu: 14 pointers, 11 int64 strides, 14 int32
# sizes and settings, 2 floats. The template static_asserts the same size.
PARAMS = struct.Struct("<14Q11q14i2f")
POINTERS = 14
assert PARAMS.size == 264
MAPS_BYTES = 512  # the second argument, ``struct TmaMaps``: four 128-byte tensor maps (x, k, v, y), read by tma tiles

launch_count = 0  # kernels launched by this process; tests read it to prove the generated kernel ran
last_launched = ""  # the key of the last kernel launched (tests read it to see which specialisation ran)


class KernelLaunchError(RuntimeError):
    """A driver call for a generated kernel failed."""


@dataclass(frozen=True)
class LoadedKernel:
    spec: KernelSpec
    function: object      # CUfunction
    handle: int           # the same CUfunction as a raw pointer, for the ctypes launch
    module: object        # CUmodule (kept so the function stays valid)
    smem_bytes: int
    threads: int
    ctas_per_sm: int      # occupancy at this shared-memory size, from the driver
    registers: int
    device_index: int


def _check(result, what: str) -> None:
    from cuda.bindings import driver as cu

    if result != cu.CUresult.CUDA_SUCCESS:
        err, name = cu.cuGetErrorName(result)
        raise KernelLaunchError(f"fusednorm: {what} failed: {name.decode() if name else result!r}")


_loaded: dict[tuple[str, int, bytes], LoadedKernel] = {}
_load_lock = threading.Lock()


def load(compiled: CompiledKernel, device_index: int) -> LoadedKernel:
    """The kernel's function handle in the primary context of ``device_index`` (the one torch uses).

    Loaded modules are keyed by the cubin as well as the kernel key: code rebuilt under the same key (a benchmark
    that edits the source or the occupancy bound) must not find the previous module."""
    key = (compiled.spec.key, device_index, hashlib.sha1(compiled.cubin).digest())
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    from cuda.bindings import driver as cu

    with _load_lock, torch.cuda.device(device_index):  # makes the device's primary context current
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        torch.cuda.current_stream(device_index)  # initialises torch's context on this device if needed
        err, module = cu.cuModuleLoadData(compiled.cubin)
        _check(err, f"cuModuleLoadData({compiled.spec.key})")
        err, function = cu.cuModuleGetFunction(module, compiled.spec.key.encode())
        _check(err, f"cuModuleGetFunction({compiled.spec.key})")
        smem = compiled.spec.smem_bytes()
        (err,) = cu.cuFuncSetAttribute(
            function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        _check(err, f"cuFuncSetAttribute(max dynamic shared memory = {smem} bytes)")
        threads = compiled.spec.tile.threads
        err, ctas = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem)
        _check(err, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if ctas < 1:
            raise KernelLaunchError(f"fusednorm: {compiled.spec.key} does not fit on one SM ({smem} bytes of "
                                    f"shared memory, {compiled.usage.registers} registers x {threads} threads)")
        loaded = LoadedKernel(compiled.spec, function, int(function), module, smem, threads, int(ctas),
                              compiled.usage.registers, device_index)
        _loaded[key] = loaded
        return loaded


# Programmatic dependent launch: an sm_90 kernel is launched so that it may start while the kernel before it in the
# stream finishes (its CTAs resident and set up when that one ends); the kernel waits before it touches global
# memory (templates/prelude.cu: wait_for_prior_grid). False: every kernel launched plainly (to compare).
programmatic_launch = True
PROGRAMMATIC_MIN_ARCH = 90
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CUDA_ERROR_INVALID_CONTEXT = 201


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union (here an int)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchArgs(threading.local):
    """The Params and TmaMaps buffers and the argv pointing at them, made once per thread instead of once per launch
    (and the launch configuration of a programmatic launch).

    cuLaunchKernel copies the parameters before it returns, so the next launch may overwrite them. It runs
    without the GIL, so a buffer shared between threads could be rewritten by another thread mid-launch: hence
    one per thread (the same size serves every kernel).
    """

    def __init__(self):
        self.params = ctypes.create_string_buffer(PARAMS.size)
        self.maps = ctypes.create_string_buffer(MAPS_BYTES)  # left as it is for kernels that do not read it
        self.argv = (ctypes.c_void_p * 2)(ctypes.addressof(self.params), ctypes.addressof(self.maps))
        self.argv_address = ctypes.addressof(self.argv)
        self.attribute = _LaunchAttribute(_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
        self.config = _LaunchConfig((1, 1, 1), (1, 1, 1), 0, None, ctypes.addressof(self.attribute), 1)
        self.config_address = ctypes.addressof(self.config)


_args = _LaunchArgs()
_cu = None  # cuda.bindings.driver, bound on the first launch (an import statement per call costs ~1 µs)
_UNSET = object()
_raw_launch = _UNSET  # libcuda's cuLaunchKernel through ctypes, or None where libcuda cannot be opened
_raw_launch_ex = None  # and its cuLaunchKernelEx (programmatic launches), None once the driver refused one


def _libcuda_launch():
    """cuLaunchKernel called through ctypes: a few µs less per launch than the cuda-python binding, which wraps
    every argument in its own types. The cuda-python binding stays the fallback and reports errors by name."""
    global _raw_launch, _raw_launch_ex
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn, fn_ex = lib.cuLaunchKernel, getattr(lib, "cuLaunchKernelEx", None)
    except (OSError, AttributeError):
        fn = fn_ex = None
    else:
        u = ctypes.c_uint
        fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        if fn_ex is not None:
            fn_ex.argtypes = [ctypes.c_void_p] * 4
            fn_ex.restype = ctypes.c_int
    _raw_launch, _raw_launch_ex = fn, fn_ex
    return fn


def _launch_programmatic(kernel: LoadedKernel, grid: int, stream: int, args: _LaunchArgs) -> bool:
    """cuLaunchKernelEx with programmatic stream serialization. False if it fails, so that the plain launch runs
    instead and reports any error that is not about this attribute; never tried again after a failure other than
    a thread without a current context (which the plain launch sets up)."""
    global _raw_launch_ex
    config = args.config
    config.grid[0], config.block[0] = grid, kernel.threads
    config.smem_bytes, config.stream = kernel.smem_bytes, stream
    err = _raw_launch_ex(args.config_address, kernel.handle, args.argv_address, None)
    if err == 0:
        return True
    if err != _CUDA_ERROR_INVALID_CONTEXT:
        _raw_launch_ex = None
    return False


def _driver():
    global _cu
    from cuda.bindings import driver

    _cu = driver
    return driver


def launch(kernel: LoadedKernel, grid: int, stream: int, pointers: tuple, tail: tuple, maps: bytes = b"") -> None:
    """Enqueue one launch on ``stream`` (a raw cudaStream_t) with Params = ``pointers`` (POINTERS) then ``tail``, and
    TmaMaps = ``maps`` (the kernels that read it)."""
    global launch_count, last_launched
    last_launched = kernel.spec.key
    args = _args
    PARAMS.pack_into(args.params, 0, *pointers, *tail)
    if maps:
        ctypes.memmove(args.maps, maps, MAPS_BYTES)
    argv = args.argv_address
    raw = _raw_launch if _raw_launch is not _UNSET else _libcuda_launch()
    if (programmatic_launch and _raw_launch_ex is not None and kernel.spec.arch >= PROGRAMMATIC_MIN_ARCH
            and _launch_programmatic(kernel, grid, stream, args)):
        launch_count += 1
        return
    if raw is not None and raw(kernel.handle, grid, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes, stream, argv,
                               None) == 0:
        launch_count += 1
        return
    cu = _cu if _cu is not None else _driver()  # no libcuda by name, or an error: the binding retries and names it
    (err,) = cu.cuLaunchKernel(kernel.function, grid, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes, stream, argv, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        if err == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            # a thread where torch never made its context current: bind the device's primary context, then retry
            _make_primary_context_current(kernel.device_index)
            (err,) = cu.cuLaunchKernel(kernel.function, grid, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes,
                                       stream, argv, 0)
        _check(err, f"cuLaunchKernel({kernel.spec.key}, grid={grid})")
    launch_count += 1


def _make_primary_context_current(device_index: int) -> None:
    from cuda.bindings import driver as cu

    err, device = cu.cuDeviceGet(device_index)
    _check(err, "cuDeviceGet")
    err, context = cu.cuDevicePrimaryCtxRetain(device)
    _check(err, "cuDevicePrimaryCtxRetain")
    (err,) = cu.cuCtxSetCurrent(context)
    _check(err, "cuCtxSetCurrent")
