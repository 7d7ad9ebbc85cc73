"""Where the code generator says what it built, so dumps, traces and fusednorm.explain can show it.

The codegen calls ``record_kernel`` once for every kernel it compiles with NVRTC (``cached=False``) and every
kernel it loads from the disk cache (``cached=True``). It is cheap when nobody listens and it never raises.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Mapping

from ..report import KernelRecord
from ..warn import warn_once

_listeners: list[Callable[[KernelRecord], None]] = []


def record_kernel(key: str, source: str, options: Iterable[Any] = (), resources: Mapping[str, Any] | None = None,
                  *, cached: bool = False) -> None:
    """key: the kernel's readable key; source: the CUDA source compiled; options: the NVRTC options (str or bytes);
    resources: figures such as {"registers": 96, "shared_memory_bytes": 49152, "spill_stores_bytes": 0,
    "spill_loads_bytes": 0, "local_memory_bytes": 0, "max_threads_per_block": 256}; cached: loaded, not compiled."""
    from . import dump, trace

    dirs = dump.active_dirs()
    if not (_listeners or dirs or trace.trace_on()):
        return
    try:
        record = KernelRecord(
            key=str(key),
            options=[o.decode() if isinstance(o, bytes) else str(o) for o in (options or ())],
            resources=dict(resources or {}),
            cached=bool(cached),
        )
        for listener in list(_listeners):
            listener(record)
        dump.dump_kernel(dirs, record, str(source))
    except Exception as e:   # seeing a kernel must never stop it from running
        warn_once(f"fusednorm: could not record kernel {key!r} ({type(e).__name__}: {e})")


@contextlib.contextmanager
def collecting(into: list):
    """Within the block, every recorded kernel is appended to `into`."""
    _listeners.append(into.append)
    try:
        yield into
    finally:
        _listeners.remove(into.append)
