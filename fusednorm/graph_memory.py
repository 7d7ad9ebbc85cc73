"""Buffers fusednorm keeps across calls (folded weights, the numerics flag) and CUDA graphs.

While a CUDA graph is warmed up or captured (``torch.cuda.graph``, Inductor's cudagraph trees), the caching
allocator sends the capturing thread's allocations to the graph's private pool, and that pool may hand memory it
believes free to a later recording (cudagraph trees restore checkpointed pool states). A buffer that outlives the
call must come from the ordinary pool instead, so a thread of fusednorm's own allocates it.
"""
from __future__ import annotations

import concurrent.futures

import torch

_allocator = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusednorm-alloc")


def capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is capturing a graph (its kernels are recorded, not run) while t is used."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def kept_copies(tensors: list) -> list:
    """Copies of ``tensors`` (None stays None), contiguous, in memory no CUDA-graph pool owns, written on the
    caller's stream. Not while capturing: the copies would only be recorded."""
    present = [t for t in tensors if t is not None]
    assert not any(capturing(t) for t in present), "kept_copies while a CUDA graph is being captured"
    empties = iter(_allocator.submit(
        lambda: [torch.empty_like(t, memory_format=torch.contiguous_format) for t in present]).result())
    copies = []
    for t in tensors:
        if t is None:
            copies.append(None)
            continue
        c = next(empties)
        if c.device.type == "cuda":  # allocated on the worker's stream, used on ours: freeing it must wait for ours
            c.record_stream(torch.cuda.current_stream(c.device))
        copies.append(c.copy_(t))
    return copies
