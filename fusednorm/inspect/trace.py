"""The same artifacts as the dumps, in PyTorch's structured trace (TORCH_TRACE=<dir>; view with tlparse)."""
from __future__ import annotations

from typing import Callable


def trace_on() -> bool:
    """True when a structured trace is being written (TORCH_TRACE is set, or someone added a handler)."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:   # a torch without structured tracing
        return False
    # torch always installs a lazy handler; without a folder (no TORCH_TRACE) it never writes anything
    return any(getattr(h, "root_dir", "") is not None or getattr(h, "stream", None) is not None
               for h in trace_log.handlers)


def emit(name: str, payload_fn: Callable[[], str], encoding: str = "string") -> None:
    """One named artifact; payload_fn only runs when a trace is being written."""
    if not trace_on():
        return
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload_fn,
        expect_trace_id=False,   # kernels are built at run time, outside any compile
    )
