"""Command line: `python -m fusednorm explain TARGET` and `python -m fusednorm cache list|clear`."""
from __future__ import annotations

import argparse
import json
import os
import sys

EXPLAIN_HELP = """\
TARGET names a callable that takes no arguments and returns (model, args) or (model, args, kwargs):
  path/to/file.py           the file's build()
  path/to/file.py:make      the file's make()
  package.module[:make]     a module's build() (or make())
The model is compiled with the fusednorm backend, run once on the inputs under torch.no_grad(),
and the report is printed: the blocks fused, the chains not fused and why."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusednorm", description="See what fusednorm does to a model; manage its "
                                "kernel cache.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{explain,cache}")

    e = sub.add_parser("explain", help="compile a model and report what was fused and what was not",
                       description=EXPLAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", metavar="TARGET", help="file.py[:callable] or package.module[:callable]")
    e.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    e.add_argument("--dump", metavar="DIR", help="write numbered dumps of every compiled graph to DIR "
                   "(as FUSEDNORM_DUMP=DIR)")
    e.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes (torch.compile dynamic=True)")

    c = sub.add_parser("cache", help="list (the default) or clear the compiled kernels in the disk cache")
    csub = c.add_subparsers(dest="action", metavar="{list,clear,path}")
    cl = csub.add_parser("list", help="one line per cached kernel: key, arch, size, age")
    cl.add_argument("--json", action="store_true", help="print the entries as JSON")
    cc = csub.add_parser("clear", help="delete cached kernels (they are compiled again when next needed)")
    cc.add_argument("--key", metavar="TEXT", help="only the kernels whose key contains TEXT")
    csub.add_parser("path", help="print the cache folder")
    return p


def _explain(ns) -> int:
    from .explain import ExplainError, explain_call
    from .inspect.target import TargetError, build

    try:
        model, args, kwargs = build(ns.target)
    except TargetError as e:
        print(f"fusednorm explain: {e}", file=sys.stderr)
        return 1
    try:
        report = explain_call(model, args, kwargs, dump_dir=ns.dump, dynamic=True if ns.dynamic else None)
    except ExplainError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(report.to_json() if ns.json else report)
    return 0


def _cache(ns) -> int:
    from .inspect import cache_cli

    if ns.action == "path":
        print(cache_cli.cache_dir())
        return 0
    if ns.action in ("list", None):
        entries = cache_cli.list_kernels()
        if getattr(ns, "json", False):
            print(json.dumps(entries, indent=2))
        else:
            print(cache_cli.format_entries(entries))
        return 0
    removed = cache_cli.clear_kernels(ns.key)
    print(f"removed {removed} cached kernel(s) from {cache_cli.cache_dir()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return _explain(ns) if ns.command == "explain" else _cache(ns)
    except BrokenPipeError:   # `... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
