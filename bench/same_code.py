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
import struct
import sys
from pathlib import Path

SOURCE_ONLY = ("line", "debug", ".symtab", ".strtab", ".shstrtab")


def elf_sections(blob: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF (a cubin); NOBITS sections map to b""."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, kind, _flags, _addr, offset, size in headers:
        start = names_at + name_off
        name = blob[start:blob.index(b"\0", start)].decode()
        out[name] = b"" if kind == 8 else blob[offset:offset + size]
    return out


def code_sections(cubin: bytes) -> dict[str, bytes]:
    return {n: v for n, v in elf_sections(cubin).items() if not any(s in n for s in SOURCE_ONLY)}


def cache_cubins(folder: Path) -> dict[str, bytes]:
    """Key -> cubin of every entry of a kernel cache folder (layout: fusednorm/codegen/cache.py)."""
    out = {}
    for path in folder.glob("*.fnk"):
        _magic, header, cubin = path.read_bytes().split(b"\n", 2)
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
