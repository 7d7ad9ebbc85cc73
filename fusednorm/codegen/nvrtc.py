"""Compile CUDA C++ to a cubin for one GPU arch with NVRTC (through cuda-python), and read ptxas's report."""
from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass

log = logging.getLogger("fusednorm")


class NvrtcError(RuntimeError):
    """NVRTC could not compile a generated kernel; the message carries the compiler log."""


@dataclass(frozen=True)
class ResourceUsage:
    registers: int
    spill_stores: int     # bytes
    spill_loads: int      # bytes
    stack_frame: int      # bytes
    static_smem: int      # bytes (the kernels use dynamic shared memory; see KernelSpec.smem_bytes)

    def as_dict(self) -> dict:
        return dict(registers=self.registers, spill_stores=self.spill_stores, spill_loads=self.spill_loads,
                    stack_frame=self.stack_frame, static_smem=self.static_smem)


def compile_options(arch: int) -> list[str]:
    return [f"--gpu-architecture=sm_{arch}", "-std=c++17", "-lineinfo", "-Xptxas=-v"]


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


def _check(err, what: str, log_text: str = "") -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"fusednorm: {what} failed ({err!r})" + (f"\n{log_text}" if log_text else ""))


def parse_ptxas_report(text: str, kernel_name: str) -> ResourceUsage:
    """The ``-Xptxas=-v`` lines for ``kernel_name``: registers, spills, stack frame, static shared memory."""
    # ptxas prints one "Function properties for NAME" block and one "Used N registers" line per entry function
    section = text
    start = text.find(f"Compiling entry function '{kernel_name}'")
    if start >= 0:
        section = text[start:]
    regs = re.search(r"Used (\d+) registers", section)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section)
    smem = re.search(r"(\d+) bytes smem", section)
    if regs is None or spills is None:
        raise NvrtcError(f"fusednorm: no ptxas resource report for {kernel_name} in the NVRTC log:\n{text}")
    return ResourceUsage(
        registers=int(regs.group(1)),
        stack_frame=int(spills.group(1)),
        spill_stores=int(spills.group(2)),
        spill_loads=int(spills.group(3)),
        static_smem=int(smem.group(1)) if smem else 0,
    )


def compile_to_cubin(source: str, kernel_name: str, arch: int) -> tuple[bytes, ResourceUsage, str]:
    """Compile ``source`` for sm_{arch}; returns (cubin, ptxas resource usage of ``kernel_name``, compiler log)."""
    log.info("fusednorm: compiling %s with NVRTC %s for sm_%d", kernel_name, nvrtc_version(), arch)
    t0 = time.perf_counter()
    cubin, log_text, ptx = _compile(source, kernel_name, arch)
    seen = (arch, hashlib.sha256(ptx).hexdigest())
    if "Used " not in log_text and seen in _usage_by_ptx:
        # NVRTC may hand back its earlier build of identical PTX without running ptxas again, and so without
        # ptxas's report (seen on the GPU machine for a source edit the compiler drops): that build's report holds.
        usage = _usage_by_ptx[seen]
    else:
        usage = parse_ptxas_report(log_text, kernel_name)
        _usage_by_ptx[seen] = usage
    log.debug("fusednorm: %s compiled in %.2f s: %s", kernel_name, time.perf_counter() - t0, usage)
    return cubin, usage, log_text


_usage_by_ptx: dict[tuple[int, str], ResourceUsage] = {}  # (arch, PTX hash) -> ptxas's report, this process


def _compile(source: str, kernel_name: str, arch: int) -> tuple[bytes, str, bytes]:
    """(cubin, compiler log, PTX) of one NVRTC compile."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{kernel_name}.cu".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in compile_options(arch)]
        (compile_err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(err, "nvrtcGetProgramLogSize")
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
        _check(err, "nvrtcGetProgramLog")
        log_text = buf.rstrip(b"\x00 ").decode(errors="replace")
        _check(compile_err, f"NVRTC compile of {kernel_name} for sm_{arch}", log_text)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = b" " * size
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
        _check(err, "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log_text, ptx
