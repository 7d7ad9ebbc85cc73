"""The disk cache: a hit skips NVRTC, a corrupt or stale entry is compiled again, concurrent compiles agree."""
from __future__ import annotations

import logging
import multiprocessing as mp

import pytest

pytest.importorskip("cuda.bindings.nvrtc")
pytest.importorskip("filelock")

from fusednorm.codegen import cache  # noqa: E402
from fusednorm.codegen.spec import KernelSpec, tile_for  # noqa: E402

SPEC = KernelSpec("bf16", 32, "rms", False, False, False, "none", False, tile_for("base", 32), 90, False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    cache.clear_memory_cache()
    yield tmp_path
    cache.clear_memory_cache()


def _forbid_compiles(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("compiled although the cache holds the kernel")

    monkeypatch.setattr(cache, "compile_to_cubin", fail)


def test_env_var_moves_the_cache(cache_dir):
    assert cache.cache_dir() == cache_dir
    assert cache.entry_path(SPEC).parent == cache_dir


def test_cold_compile_logs_then_hits(cache_dir, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        first = cache.get_kernel(SPEC)
    assert not first.from_disk and first.cubin
    assert any("compiling" in r.message and SPEC.key in r.message for r in caplog.records)
    assert cache.entry_path(SPEC).exists()

    cache.clear_memory_cache()
    _forbid_compiles(monkeypatch)
    second = cache.get_kernel(SPEC)
    assert second.from_disk and second.cubin == first.cubin and second.usage == first.usage
    assert cache.get_kernel(SPEC) is second  # the in-process layer answers too


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "stale_source"])
def test_bad_entry_is_recompiled(cache_dir, damage, caplog):
    good = cache.get_kernel(SPEC)
    path = cache.entry_path(SPEC)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    elif damage == "garbage":
        path.write_bytes(b"not a kernel")
    else:
        path.write_bytes(data.replace(b'"fingerprint": "', b'"fingerprint": "0', 1))
    cache.clear_memory_cache()
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        again = cache.get_kernel(SPEC)
    assert not again.from_disk, "a damaged entry must not be loaded"
    assert again.cubin == good.cubin
    assert any("compiling" in r.message for r in caplog.records)
    cache.clear_memory_cache()
    assert cache.get_kernel(SPEC).from_disk, "the rewritten entry is whole"


def test_no_temporary_files_left(cache_dir):
    cache.get_kernel(SPEC)
    assert not list(cache_dir.glob("*.tmp"))


def _compile_in_child(directory, start, out):
    import os

    os.environ[cache.ENV_VAR] = directory
    start.wait(30)
    kernel = cache.get_kernel(SPEC)
    out.put((kernel.from_disk, kernel.cubin))


def test_two_processes_compile_one_key(cache_dir):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(cache_dir), start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(r[0] for r in results) == [False, True], "exactly one process compiles; the other reads"
    assert results[0][1] == results[1][1]


def test_a_real_compile_lands_in_the_dump_with_its_resources(tmp_path, monkeypatch):
    """The codegen reports what it builds: with FUSEDNORM_DUMP set, the NVRTC compile writes source + figures."""
    import json

    from fusednorm.codegen.cache import clear_memory_cache, get_kernel

    dump_dir = tmp_path / "dump"
    monkeypatch.setenv("FUSEDNORM_DUMP", str(dump_dir))
    clear_memory_cache()
    kernel = get_kernel(SPEC, directory=tmp_path / "cache")
    source = (dump_dir / "kernels" / f"{SPEC.key}.cu").read_text()
    meta = json.loads((dump_dir / "kernels" / f"{SPEC.key}.json").read_text())
    assert "__global__" in source
    assert meta["key"] == SPEC.key and meta["cached"] is False
    assert meta["resources"]["registers"] == kernel.usage.registers > 0
    assert meta["resources"]["spill_stores"] == 0
    assert meta["resources"]["dynamic_smem"] == SPEC.smem_bytes() > 0  # the bytes, not the method's repr
    assert any("sm_90" in o for o in meta["options"])
