"""Do two kernel caches hold the same machine code? For source edits meant to change nothing the GPU runs (comments,
moved text, split files), on a machine without a GPU.

    python bench/prebuild_kernels.py --out /tmp/fnk_a      # in one checkout, then in the other:
    python bench/prebuild_kernels.py --out /tmp/fnk_b
    python bench/same_code.py /tmp/fnk_a /tmp/fnk_b

Kernels are built with -lineinfo, so any edit that moves a line changes the cubin's bytes. This compares each
key's cubin section by section, leaving out what only describes the source (line tables, debug sections, the
embedded PTX text, and the symbol and string tables that index them). Exit status 1 when any code section differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusednorm.codegen.cache import MAGIC  # noqa: E402
from fusednorm.codegen.nvrtc import elf_sections  # noqa: E402

SOURCE_ONLY = ("line", "debug", ".symtab", ".strtab", ".shstrtab")


def code_sections(cubin: bytes) -> dict[str, bytes]:
    return {n: v for n, v in elf_sections(cubin).items() if not any(s in n for s in SOURCE_ONLY)}


def cache_cubins(folder: Path) -> dict[str, bytes]:
    """Key -> cubin of every entry of a kernel cache folder (layout: fusednorm/codegen/cache.py)."""
    out = {}
    for path in folder.glob("*.fnk"):
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise SystemExit(f"{path}: not a fusednorm kernel entry")
        header, cubin = data[len(MAGIC):].split(b"\n", 1)
        out[json.loads(header)["key"]] = cubin
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args()
    a, b = cache_cubins(args.a), cache_cubins(args.b)
    shared = sorted(set(a) & set(b))
    differing = {}
    for key in shared:
        ca, cb = code_sections(a[key]), code_sections(b[key])
        names = sorted(n for n in set(ca) | set(cb) if ca.get(n) != cb.get(n))
        if names:
            differing[key] = names
    print(f"{len(shared)} kernels in both ({len(a) - len(shared)} only in {args.a}, {len(b) - len(shared)} only in "
          f"{args.b}): {len(shared) - len(differing)} with the same code, {len(differing)} differ")
    for key, names in sorted(differing.items())[:20]:
        print(f"  {key}: {', '.join(names)}")
    return 1 if differing or not shared else 0


if __name__ == "__main__":
    sys.exit(main())
