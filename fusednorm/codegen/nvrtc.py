"""Compile CUDA C++ to a cubin for one GPU arch with NVRTC (through cuda-python), and read ptxas's report."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import struct
import sys
import time
from dataclasses import dataclass

log = logging.getLogger("fusednorm")


class NvrtcError(RuntimeError):
    """NVRTC could not compile a generated kernel; the message carries the compiler log."""


@dataclass(frozen=True)
class ResourceUsage:
    registers: int
    spill_stores: int | None  # bytes; None: not known (read from the cubin, see usage_from_cubin)
    spill_loads: int | None   # bytes; None likewise
    stack_frame: int      # bytes
    static_smem: int      # bytes (the kernels use dynamic shared memory; see KernelSpec.smem_bytes)

    def as_dict(self) -> dict:
        return dict(registers=self.registers, spill_stores=self.spill_stores, spill_loads=self.spill_loads,
                    stack_frame=self.stack_frame, static_smem=self.static_smem)


def compile_options(arch: int) -> list[str]:
    # sm_90 builds target sm_90a, whose warpgroup mma (wgmma) the sm_90 tiles use; such a cubin runs on sm_90 only,
    # which is the one arch a build for 90 is ever loaded on
    target = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    return [f"--gpu-architecture={target}", "-std=c++17", "-lineinfo", "-Xptxas=-v"]


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


@functools.cache
def load_builtins_beside_nvrtc() -> str | None:
    """Load NVRTC's builtins library from the folder its libnvrtc was loaded from; returns its path, if loaded.

    NVRTC opens libnvrtc-builtins.so.MAJOR.MINOR by name when it compiles. Some nvidia-cuda-nvrtc wheels (13.0,
    which torch 2.14's CUDA builds pin) ship a libnvrtc without a run path, so that name resolves only if the
    loader's search path holds the wheel's folder, which a pip install never sets, and every compile fails with
    "failed to open libnvrtc-builtins". Loaded once beforehand, the library is found by its name.
    """
    if not sys.platform.startswith("linux"):
        return None
    major, minor = nvrtc_version().split(".")  # also makes cuda-python load libnvrtc
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libnvrtc.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        builtins = os.path.join(os.path.dirname(path), f"libnvrtc-builtins.so.{major}.{minor}")
        if os.path.exists(builtins):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return builtins
    return None


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
    cubin, log_text = _compile(source, kernel_name, arch)
    if "Used " in log_text:
        usage = parse_ptxas_report(log_text, kernel_name)
    else:
        # On a machine with a GPU driver, NVRTC serves a build it has made before (in any process) from the CUDA
        # compute cache without running ptxas, and so without ptxas's report: read what the cubin records instead.
        usage = usage_from_cubin(cubin, kernel_name)
    log.debug("fusednorm: %s compiled in %.2f s: %s", kernel_name, time.perf_counter() - t0, usage)
    return cubin, usage, log_text


# .nv.info attributes (format 0x04: u8 format, u8 attribute, u16 size, payload), each keyed by a symbol index
_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F


def usage_from_cubin(cubin: bytes, kernel_name: str) -> ResourceUsage:
    """Registers and stack frame of ``kernel_name`` as its cubin's .nv.info section records them (spill bytes are
    not recorded there: None)."""
    sections = elf_sections(cubin)
    symtab = sections.get(".symtab")
    if symtab is None or ".nv.info" not in sections:
        raise NvrtcError(f"fusednorm: the cubin of {kernel_name} has no .symtab or .nv.info section")
    strtab = sections[".strtab"]
    index = None
    for i in range(len(symtab) // 24):  # Elf64_Sym: u32 name, u8 info, u8 other, u16 shndx, u64 value, u64 size
        name_off = struct.unpack_from("<I", symtab, 24 * i)[0]
        if strtab[name_off:strtab.index(b"\0", name_off)] == kernel_name.encode():
            index = i
    info, found, at = sections[".nv.info"], {}, 0
    while at + 4 <= len(info):
        fmt, attr, size = info[at], info[at + 1], struct.unpack_from("<H", info, at + 2)[0]
        if fmt != 0x04:  # the other formats carry their value in the size field: nothing follows
            at += 4
            continue
        if size >= 8 and attr in (_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT):
            symbol, value = struct.unpack_from("<II", info, at + 4)
            if symbol == index:
                found[attr] = value
        at += 4 + size
    if _EIATTR_REGCOUNT not in found:
        raise NvrtcError(f"fusednorm: no ptxas report for {kernel_name}, and its cubin records no register count")
    return ResourceUsage(registers=found[_EIATTR_REGCOUNT], spill_stores=None, spill_loads=None,
                         stack_frame=found.get(_EIATTR_FRAME_SIZE, 0), static_smem=0)


def elf_sections(elf: bytes) -> dict[str, bytes]:
    """Name -> contents of an ELF64 (little-endian) file's sections."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    names = elf[headers[names_at][4]:headers[names_at][4] + headers[names_at][5]]
    return {names[h[0]:names.index(b"\0", h[0])].decode(): elf[h[4]:h[4] + h[5]] for h in headers}


def _compile(source: str, kernel_name: str, arch: int) -> tuple[bytes, str]:
    """(cubin, compiler log) of one NVRTC compile."""
    from cuda.bindings import nvrtc

    load_builtins_beside_nvrtc()
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
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log_text
