"""Numbered dumps of every compiled graph (FUSEDNORM_DUMP=<dir> or options={"dump_dir": <dir>}).

Layout, one folder per graph Dynamo hands to the backend, numbered in compile order within a process:

    <dir>/graph_001/00_<pass>.py ...     the graph before the passes and after each pass, as annotated Python
    <dir>/graph_001/report.txt, .json    what was fused in this graph, and what was not and why
    <dir>/graph_001/rewritten.mlir       the rewritten graph in torch-mlir's torch dialect
                                         (rewritten.mlir.txt says why, where torch-mlir cannot make it)
    <dir>/kernels/<key>.cu, <key>.json   each generated kernel's source; its compiler options and resources
    <dir>/report.txt, .json              the whole report (written by fusednorm.explain)

Writing a dump never fails a compile: an error is reported once as a warning and the compile goes on.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil

from ..warn import warn_once
from . import trace

_used_dirs: dict[str, None] = {}     # dump folders written this process (ordered); kernels go to each
_fresh_graph_dirs: set[str] = set()  # graph folders emptied of a previous run's files
_failed: set[str] = set()            # kinds of dump that failed and were warned about (once each)


def enabled(dump_dir: str | None) -> bool:
    """True when a dump folder is set or a structured trace is being written."""
    return bool(dump_dir) or trace.trace_on()


def active_dirs() -> list[str]:
    env = os.environ.get("FUSEDNORM_DUMP")
    dirs = list(_used_dirs)
    return dirs + [env] if env and env not in _used_dirs else dirs


def _never_fails(what: str):
    def wrap(fn):
        @functools.wraps(fn)
        def safe(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:   # a dump is a side product: the compile must go on
                if what not in _failed:
                    _failed.add(what)
                    warn_once(f"fusednorm: could not write the {what} dump ({type(e).__name__}: {e}); "
                              "compilation goes on without it")
        return safe
    return wrap


def slug(text: str, limit: int = 100) -> str:
    """text as a file-name part: odd characters become '_'; a long one is cut and keeps a hash of the whole."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_") or "unnamed"
    if len(clean) <= limit:
        return clean
    return clean[:limit] + "_" + hashlib.sha1(str(text).encode()).hexdigest()[:10]


def graph_dir(dump_dir: str, graph_id: int) -> str:
    """The graph's folder; the first use in this process clears files a previous run left there."""
    path = os.path.join(dump_dir, f"graph_{graph_id:03d}")
    if path not in _fresh_graph_dirs:
        _fresh_graph_dirs.add(path)
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    _used_dirs.setdefault(dump_dir, None)
    return path


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)   # a reader never sees half a file


@_never_fails("graph")
def dump_graph(dump_dir: str | None, graph_id: int, index: int, name: str, gm, report=None) -> None:
    """The graph after pass number `index` called `name` (index 0: before any pass). After the last pass, also
    the rewritten graph as MLIR and, given the graph's report, report.txt / report.json."""
    _graph_file(dump_dir, graph_id, index, name, gm)
    if index == _last_pass_index():
        dump_mlir(dump_dir, graph_id, gm)
        if report is not None:
            dump_report(dump_dir, report, graph_id)


def _last_pass_index() -> int:
    from ..passes import PIPELINE

    return len(PIPELINE)


@_never_fails("graph")
def _graph_file(dump_dir: str | None, graph_id: int, index: int, name: str, gm) -> None:
    from .graph_text import readable_graph

    stage = "before the passes" if index == 0 else f"after pass {index} ({name})"
    # made once, whether the file, the trace or both want it
    text = functools.lru_cache(maxsize=1)(lambda: readable_graph(gm, f"fusednorm graph {graph_id}, {stage}"))
    if dump_dir:
        _write(os.path.join(graph_dir(dump_dir, graph_id), f"{index:02d}_{slug(name)}.py"), text())
    trace.emit(f"fusednorm_graph_{graph_id:03d}_{index:02d}_{slug(name)}", text)


@_never_fails("report")
def dump_report(dump_dir: str | None, report, graph_id: int | None = None) -> None:
    """report.txt and report.json: in the graph's folder for one graph, at the top for a whole explain."""
    if graph_id is not None:
        report = report.for_graph(graph_id)
    if dump_dir:
        folder = graph_dir(dump_dir, graph_id) if graph_id is not None else dump_dir
        os.makedirs(folder, exist_ok=True)
        _write(os.path.join(folder, "report.txt"), str(report) + "\n")
        _write(os.path.join(folder, "report.json"), report.to_json() + "\n")
    tag = f"graph_{graph_id:03d}_" if graph_id is not None else ""
    trace.emit(f"fusednorm_{tag}report", lambda: str(report))
    trace.emit(f"fusednorm_{tag}report_json", report.to_json, encoding="json")


@_never_fails("MLIR")
def dump_mlir(dump_dir: str | None, graph_id: int, gm, example_inputs=None) -> None:
    """rewritten.mlir, or rewritten.mlir.txt with the reason where torch-mlir cannot make it."""
    from .mlir import graph_to_mlir, mlir_available

    if not dump_dir and not trace.trace_on():
        return   # making MLIR costs a trace of the graph: only when someone will read it
    reason = mlir_available()
    text, error = None, None
    if reason is None:
        try:
            text = graph_to_mlir(gm, example_inputs, func_name=f"graph_{graph_id:03d}")
        except Exception as e:   # an op torch.export or the importer cannot take: say so in the note
            error = f"torch-mlir could not import this graph: {type(e).__name__}: {e}"
            warn_once(f"fusednorm: MLIR dump of graph {graph_id} failed ({type(e).__name__}: {e})")
    note = reason or error
    if dump_dir:
        folder = graph_dir(dump_dir, graph_id)
        if text is not None:
            _write(os.path.join(folder, "rewritten.mlir"), text)
        else:
            _write(os.path.join(folder, "rewritten.mlir.txt"), f"No MLIR for graph {graph_id}: {note}\n")
    trace.emit(f"fusednorm_graph_{graph_id:03d}_mlir", lambda: text if text is not None else f"No MLIR: {note}")


@_never_fails("kernel")
def dump_kernel(dump_dirs: list[str], record, source: str) -> None:
    """kernels/<key>.cu (the source) and kernels/<key>.json (key, compiler options, resources) in each folder."""
    name = slug(record.key)
    meta = json.dumps({"key": record.key, "options": record.options, "resources": record.resources,
                       "cached": record.cached}, indent=2, default=str)
    for dump_dir in dump_dirs:
        folder = os.path.join(dump_dir, "kernels")
        os.makedirs(folder, exist_ok=True)
        _write(os.path.join(folder, f"{name}.cu"), source)
        _write(os.path.join(folder, f"{name}.json"), meta + "\n")
    trace.emit(f"fusednorm_kernel_{name}.cu", lambda: source)
    trace.emit(f"fusednorm_kernel_{name}.json", lambda: meta, encoding="json")
