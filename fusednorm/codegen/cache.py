"""The on-disk kernel cache: one file per kernel key, guarded by a file lock, written atomically.

Entry layout: a magic line, one JSON header line (the key, a fingerprint of the source + compile options + NVRTC
version, the cubin's sha256 and its resource usage), then the cubin bytes. An entry whose header, fingerprint or
checksum does not match is compiled again and replaced. The default folder is the user's cache dir
(platformdirs); ``FUSEDNORM_CACHE_DIR`` moves it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .nvrtc import ResourceUsage, compile_options, compile_to_cubin, nvrtc_version
from .render import render
from .spec import KernelSpec

log = logging.getLogger("fusednorm")

MAGIC = b"FUSEDNORM-KERNEL 1\n"
ENV_VAR = "FUSEDNORM_CACHE_DIR"


@dataclass(frozen=True)
class CompiledKernel:
    spec: KernelSpec
    cubin: bytes
    usage: ResourceUsage
    from_disk: bool   # True when the cubin came from the disk cache rather than a compile in this call


def cache_dir() -> Path:
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("fusednorm")) / "kernels"
    except ImportError:  # platformdirs is a declared dependency; stay usable where it is missing
        return Path.home() / ".cache" / "fusednorm" / "kernels"


def fingerprint(source: str, arch: int) -> str:
    h = hashlib.sha256()
    h.update(source.encode())
    h.update("\0".join(compile_options(arch)).encode())
    h.update(nvrtc_version().encode())
    return h.hexdigest()


def entry_path(spec: KernelSpec, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"{spec.key}.fnk"


def _read_entry(path: Path, spec: KernelSpec, fp: str) -> CompiledKernel | None:
    """The entry if it is intact and was built from this source; None otherwise."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("fusednorm: cannot read kernel cache entry %s (%s); compiling again", path, e)
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("bad magic")
        header_end = data.index(b"\n", len(MAGIC))
        header = json.loads(data[len(MAGIC):header_end])
        cubin = data[header_end + 1:]
        if header["key"] != spec.key:
            raise ValueError(f"key {header['key']!r}")
        if header["fingerprint"] != fp:
            log.info("fusednorm: kernel cache entry %s is from other source or options; compiling again", path.name)
            return None
        if hashlib.sha256(cubin).hexdigest() != header["cubin_sha256"]:
            raise ValueError("cubin checksum mismatch")
        usage = ResourceUsage(**header["usage"])
    except (ValueError, KeyError, TypeError) as e:
        log.warning("fusednorm: kernel cache entry %s is corrupt (%s); compiling again", path, e)
        return None
    return CompiledKernel(spec, cubin, usage, from_disk=True)


def _write_entry(path: Path, spec: KernelSpec, fp: str, cubin: bytes, usage: ResourceUsage) -> None:
    header = {"key": spec.key, "fingerprint": fp, "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
              "usage": usage.as_dict()}
    blob = MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + cubin
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old entry or the new one, never half of one
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_memory: dict[str, CompiledKernel] = {}
_memory_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


def get_kernel(spec: KernelSpec, directory: Path | None = None) -> CompiledKernel:
    """The compiled kernel for ``spec``: from this process's memory, the disk cache, or a fresh NVRTC compile."""
    directory = Path(directory) if directory is not None else cache_dir()
    mem_key = f"{directory}/{spec.key}"
    hit = _memory.get(mem_key)
    if hit is not None:
        return hit
    with _memory_lock:
        key_lock = _key_locks.setdefault(mem_key, threading.Lock())
    with key_lock:  # one compile per key in this process; the file lock does the same across processes
        hit = _memory.get(mem_key)
        if hit is not None:
            return hit
        from filelock import FileLock

        directory.mkdir(parents=True, exist_ok=True)
        source = render(spec)
        fp = fingerprint(source, spec.arch)
        path = entry_path(spec, directory)
        with FileLock(str(path) + ".lock"):
            kernel = _read_entry(path, spec, fp)
            if kernel is None:
                cubin, usage, _ = compile_to_cubin(source, spec.key, spec.arch)
                _write_entry(path, spec, fp, cubin, usage)
                kernel = CompiledKernel(spec, cubin, usage, from_disk=False)
        _memory[mem_key] = kernel
    from ..inspect.kernels import record_kernel  # dumps, traces and explain show what was built

    record_kernel(spec.key, source, compile_options(spec.arch),
                  {**kernel.usage.as_dict(), "dynamic_smem": spec.smem_bytes()}, cached=kernel.from_disk)
    return kernel


def clear_memory_cache() -> None:
    """Forget the kernels held in this process (the disk cache stays)."""
    with _memory_lock:
        _memory.clear()
