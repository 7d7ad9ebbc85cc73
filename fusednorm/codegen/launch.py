"""Load cubins into torch's CUDA context (once per kernel key and device) and launch them with the driver API on
torch's current stream. The per-call path is kept thin: one struct pack, one cuLaunchKernel."""
from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

import torch

from .cache import CompiledKernel
from .spec import KernelSpec

# The kernel's single argument, ``struct Params`` in templates/pnca.cu: 8 pointers, 9 int64 strides, 9 int32
# sizes, 2 floats, padded to 8 bytes. The template static_asserts the same size.
PARAMS = struct.Struct("<8Q9q9i2f4x")
assert PARAMS.size == 184

launch_count = 0  # kernels launched by this process; tests read it to prove the generated kernel ran


class KernelLaunchError(RuntimeError):
    """A driver call for a generated kernel failed."""


@dataclass(frozen=True)
class LoadedKernel:
    spec: KernelSpec
    function: object      # CUfunction
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


_loaded: dict[tuple[str, int], LoadedKernel] = {}
_load_lock = threading.Lock()


def load(compiled: CompiledKernel, device_index: int) -> LoadedKernel:
    """The kernel's function handle in the primary context of ``device_index`` (the one torch uses)."""
    key = (compiled.spec.key, device_index)
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
        loaded = LoadedKernel(compiled.spec, function, module, smem, threads, int(ctas), compiled.usage.registers,
                              device_index)
        _loaded[key] = loaded
        return loaded


def launch(kernel: LoadedKernel, grid: int, params: bytes, stream: int) -> None:
    """Enqueue one launch on ``stream`` (a raw cudaStream_t, e.g. torch.cuda.current_stream().cuda_stream)."""
    global launch_count
    from cuda.bindings import driver as cu

    buf = ctypes.create_string_buffer(params, PARAMS.size)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    (err,) = cu.cuLaunchKernel(kernel.function, grid, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes, stream,
                               ctypes.addressof(argv), 0)
    if err == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # a thread where torch never made its context current: bind the device's primary context, then retry
        _make_primary_context_current(kernel.device_index)
        (err,) = cu.cuLaunchKernel(kernel.function, grid, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes, stream,
                                   ctypes.addressof(argv), 0)
    if err != cu.CUresult.CUDA_SUCCESS:
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
