"""`python -m fusednorm cache list|clear|path`: the compiled kernels in the disk cache.

The cache is fusednorm/codegen/cache.py's folder (FUSEDNORM_CACHE_DIR, else the user's cache dir): one
``<key>.fnk`` file per kernel (a magic line, a JSON header with the key and the ptxas resource usage, then the
cubin) and a ``<key>.fnk.lock`` file beside it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

ENTRY_SUFFIX = ".fnk"


def cache_dir() -> Path:
    from ..codegen.cache import cache_dir as codegen_cache_dir

    return Path(codegen_cache_dir())


def _header(path: Path) -> dict:
    """The entry's JSON header, or {"problem": ...} when the file is not a readable entry."""
    from ..codegen.cache import MAGIC

    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return {"problem": "not a fusednorm kernel entry (bad magic line)"}
            return json.loads(f.readline())
    except (OSError, ValueError) as e:
        return {"problem": f"unreadable ({type(e).__name__}: {e})"}


def list_kernels() -> list[dict]:
    """One dict per entry: key, file, bytes, modified (ISO time), usage (registers, spills ...), problem."""
    folder = cache_dir()
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob(f"*{ENTRY_SUFFIX}")):
        header = _header(path)
        stat = path.stat()
        out.append({
            "key": header.get("key", path.name[:-len(ENTRY_SUFFIX)]),
            "file": str(path),
            "bytes": stat.st_size,
            "modified": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(stat.st_mtime)),
            "usage": header.get("usage", {}),
            "problem": header.get("problem", ""),
        })
    return out


def clear_kernels(key_contains: str | None = None) -> int:
    """Delete the entries (whose key contains `key_contains`, if given); returns how many were deleted."""
    from filelock import FileLock

    folder = cache_dir()
    if not folder.is_dir():
        return 0
    removed = 0
    for path in folder.glob(f"*{ENTRY_SUFFIX}"):
        if key_contains and key_contains not in path.name[:-len(ENTRY_SUFFIX)]:
            continue
        lock = Path(f"{path}.lock")
        with FileLock(str(lock)):   # never under a process that is writing this entry
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            lock.unlink(missing_ok=True)
    if not key_contains:   # half-written entries a killed process left behind
        for tmp in folder.glob(f"*{ENTRY_SUFFIX}.*.tmp"):
            tmp.unlink(missing_ok=True)
    return removed


def format_entries(entries: list[dict]) -> str:
    from .table import brief, format_table

    if not entries:
        return f"no cached kernels in {cache_dir()}"
    rows = [[e["key"], brief(e["usage"].get("registers", "")), brief(e["usage"].get("spill_stores", "")),
             str(e["bytes"]), e["modified"], e["problem"]] for e in entries]
    lines = [f"{len(entries)} cached kernel(s) in {cache_dir()}"]
    lines += format_table(["key", "registers", "spill stores", "bytes", "modified", "problem"], rows)
    return "\n".join(lines)

