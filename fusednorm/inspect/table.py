"""str(report): aligned tables of fused blocks, their op arguments, chains not fused, kernels and notes."""
from __future__ import annotations

import os
import re

from ..report import jsonable

_ROLE_ORDER = ("norm", "attention", "add")


def format_table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    out = []
    for row in cells:
        padded = [c.ljust(w) for c, w in zip(row[:-1], widths)] + [row[-1]]
        out.append((indent + "  ".join(padded)).rstrip())
    return out


_LOCATION = re.compile(r"^(.*?):(\d+)(.*)$")


def short_location(location: str) -> str:
    """'file:line ...' shortened for reading: the path relative to the working directory, or from site-packages on."""
    if not location:
        return "?"
    found = _LOCATION.match(location)
    path, line, rest = found.groups() if found else (location, "", "")
    marker = "site-packages" + os.sep
    if marker in path:
        path = path.split(marker, 1)[1]
    else:
        try:
            rel = os.path.relpath(path)
            if not rel.startswith(".."):
                path = rel
        except ValueError:   # another drive on Windows
            pass
    return (f"{path}:{line}" if line else path) + rest


def brief(value) -> str:
    """A summary value as text: lists without spaces, dtypes without 'torch.'."""
    value = jsonable(value)
    if isinstance(value, list):
        return "[" + ",".join(brief(v) for v in value) + "]"
    if isinstance(value, dict):
        return " ".join(f"{k}={brief(v)}" for k, v in value.items())
    if value is None:
        return "-"
    return str(value)


def _roles(records) -> list[str]:
    seen = [r for r in _ROLE_ORDER if any(r in rec.locations for rec in records)]
    for rec in records:
        seen += [r for r in rec.locations if r not in seen]
    return seen


def _summary_keys(matches) -> list[str]:
    keys: list[str] = []
    for m in matches:
        keys += [k for k in m.summary if k not in keys]
    return keys


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def format_report(report) -> str:
    head = (f"fusednorm: {_plural(len(report.matches), 'block')} fused, "
            f"{_plural(len(report.near_misses), 'chain')} not fused")
    if report.graphs:
        head += f" ({_plural(report.graphs, 'graph')} compiled)"
    lines = [head]

    if report.matches:
        roles = _roles(report.matches)
        lines += ["", "Fused blocks"]
        lines += format_table(
            ["#", "graph", "pattern", *roles, "runs"],
            [[str(i), str(m.graph), m.pattern, *(short_location(m.locations.get(r, "")) for r in roles),
              m.runs or "?"] for i, m in enumerate(report.matches, 1)],
        )
        keys = _summary_keys(report.matches)
        if keys:
            lines += ["", "Fused op arguments"]
            lines += format_table(
                ["#", *keys],
                [[str(i), *(brief(m.summary[k]) if k in m.summary else "" for k in keys)]
                 for i, m in enumerate(report.matches, 1)],
            )

    if report.near_misses:
        roles = _roles(report.near_misses)
        lines += ["", "Not fused"]
        lines += format_table(
            ["#", "graph", "closest pattern", *roles, "reason"],
            [[str(i), str(n.graph), n.pattern or "-", *(short_location(n.locations.get(r, "")) for r in roles),
              n.reason] for i, n in enumerate(report.near_misses, 1)],
        )

    if report.kernels:
        lines += ["", "Kernels"]
        res_keys: list[str] = []
        for k in report.kernels:
            res_keys += [r for r in k.resources if r not in res_keys]
        lines += format_table(
            ["key", *res_keys, "from"],
            [[k.key, *(brief(k.resources.get(r, "")) for r in res_keys), "cache" if k.cached else "compiled"]
             for k in report.kernels],
        )

    if report.notes:
        lines += ["", "Notes"]
        lines += [f"  - {note}" for note in report.notes]
    return "\n".join(lines)
