"""What one compile did: the blocks fused (matches) and the chains left alone (near-misses), with reasons.

``str(report)`` is a readable table; ``report.to_dict()`` / ``report.to_json()`` hold the same facts as plain JSON,
and ``Report.from_dict`` / ``Report.from_json`` read them back.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


@dataclass
class MatchRecord:
    pattern: str                      # the pattern's registered name
    locations: dict[str, str]         # role ("norm", "attention", "add") -> "file:line" in the user's code
    summary: dict[str, Any]           # the fused op's arguments in brief: shapes, dtypes, norm, projections, mask
    runs: str = ""                    # what runs it: a kernel key, a plan, "reference", or "left to the compiler"
    graph: int = 0                    # which compiled graph (Dynamo may split a model into several)


@dataclass
class NearMiss:
    reason: str                       # in words: why the chain was not fused
    locations: dict[str, str]
    pattern: str = ""                 # the pattern (or family) that came closest, if any
    graph: int = 0


@dataclass
class KernelRecord:
    key: str                          # the kernel's readable key (what its code is specialised on)
    options: list[str] = field(default_factory=list)       # compiler options it was built with
    resources: dict[str, Any] = field(default_factory=dict)  # registers, shared memory, spills, ...
    cached: bool = False              # True: loaded from the disk cache, not compiled in this process


@dataclass
class Report:
    matches: list[MatchRecord] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # e.g. "a pass failed; the graph ran unfused"
    kernels: list[KernelRecord] = field(default_factory=list)  # kernels built or loaded while explaining
    graphs: int = 0                                   # graphs Dynamo made (0: not counted)
    # per Dynamo compile (frame): its latest attempt and the graph ids of that attempt (not part of the report's facts)
    _attempts: dict = field(default_factory=dict, repr=False, compare=False)

    def extend(self, other: "Report") -> None:
        self.matches += other.matches
        self.near_misses += other.near_misses
        self.notes += other.notes
        self.kernels += other.kernels

    def add_graph(self, other: "Report", graph: int, trace=None) -> None:
        """Add one compiled graph's part. ``trace``: Dynamo's (compile id, attempt) for it; when Dynamo restarts its
        analysis of a frame (it does with dynamic=True, e.g. after specialising a float) and compiles it again, the
        graphs of the earlier attempt were thrown away, and so is their part of the report."""
        if trace is not None:
            compile_id, attempt = trace
            seen_attempt, graphs = self._attempts.get(compile_id, (attempt, []))
            if attempt > seen_attempt:
                self.matches = [m for m in self.matches if m.graph not in graphs]
                self.near_misses = [n for n in self.near_misses if n.graph not in graphs]
                seen_attempt, graphs = attempt, []
            self._attempts[compile_id] = (seen_attempt, graphs + [graph])
        self.extend(other)

    def for_graph(self, graph: int) -> "Report":
        """The part of this report about one compiled graph."""
        return Report(
            matches=[m for m in self.matches if m.graph == graph],
            near_misses=[n for n in self.near_misses if n.graph == graph],
            graphs=1,
        )

    def to_dict(self) -> dict:
        """Plain JSON types only: dtypes, shapes and symbolic sizes become strings and lists."""
        return {
            "graphs": self.graphs,
            "matches": [_record_dict(m) for m in self.matches],
            "near_misses": [_record_dict(n) for n in self.near_misses],
            "kernels": [_record_dict(k) for k in self.kernels],
            "notes": [str(n) for n in self.notes],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        if not isinstance(data, dict):
            raise TypeError(f"fusednorm report: expected a dict, got {type(data).__name__}")
        return cls(
            matches=[_record_from(MatchRecord, d, f"matches[{i}]") for i, d in enumerate(data.get("matches", []))],
            near_misses=[_record_from(NearMiss, d, f"near_misses[{i}]")
                         for i, d in enumerate(data.get("near_misses", []))],
            kernels=[_record_from(KernelRecord, d, f"kernels[{i}]") for i, d in enumerate(data.get("kernels", []))],
            notes=list(data.get("notes", [])),
            graphs=int(data.get("graphs", 0)),
        )

    @classmethod
    def from_json(cls, text: str) -> "Report":
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        from .inspect.table import format_report

        return format_report(self)


def jsonable(value: Any) -> Any:
    """value with torch objects turned into JSON types (dtype -> "float16", Size -> list, SymInt -> "s0")."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):   # torch.Size is a tuple
        return [jsonable(v) for v in value]
    text = str(value)
    return text[len("torch."):] if text.startswith("torch.") else text


def _record_dict(record) -> dict:
    return {f.name: jsonable(getattr(record, f.name)) for f in fields(record)}


def _record_from(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise TypeError(f"fusednorm report: {where} must be a dict, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"fusednorm report: {where} lacks {missing}")
    # fields a newer fusednorm added are dropped, so old readers still load new reports
    return cls(**{k: v for k, v in data.items() if k in names})

