"""Do two kernel caches hold the same machine code? For source edits meant to change nothing the GPU runs (comments,
moved text, split files), on a machine without a GPU.

    python bench/prebuild_kernels.py --out /tmp/fnk_a      # in one checkout, then in the other:
    python bench/prebuild_kernels.py --out /tmp/fnk_b
    python bench/same_code.py /tmp/fnk_a /tmp/fnk_b

Kernels are built with -lineinfo, so any edit that moves a line changes the cubin's bytes. This compares each
key's cubin section by section, leaving out what only describes the source (line tables, debug sections, the
embedded PTX text, and the symbol and string tables that index them). Exit status 1 when any code section differs.

    python bench/same_code.py /tmp/fnk_a /tmp/fnk_b --sass

also disassembles (nvdisasm) each kernel whose sections differ and compares its instructions: a new configuration
constant adds to the constant tables (`.nv.global.init`, `.nv.constant4`) without changing one instruction. Exit
status 1 then only when instructions differ.

    python bench/same_code.py /tmp/fnk_a /tmp/fnk_b --sass --mask-params

compares the instructions with every operand of constant bank 0 (the kernel's parameters) read as one: a field
added to `struct Params` moves the offsets of those after it in every kernel, and nothing else. (A field that the
code picks by an offset computed in a register, as gamma or beta by index, then still differs: add fields after
the pointers.)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusednorm.codegen.cache import MAGIC  # noqa: E402
from fusednorm.codegen.nvrtc import elf_sections  # noqa: E402
from sass_census import disassemble, find_nvdisasm  # noqa: E402  (beside this file)

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


PARAM_OPERAND = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def sass(cubin: bytes, nvdisasm: str, mask_params: bool = False) -> list[str]:
    """The cubin's instructions as text, without addresses and encodings (and with ``mask_params``, every operand
    of constant bank 0 as ``c[0x0][param]``)."""
    lines = (re.sub(r"/\*.*?\*/", "", line).strip() for line in disassemble(cubin, nvdisasm).splitlines())
    if mask_params:
        lines = (PARAM_OPERAND.sub("c[0x0][param]", line) for line in lines)
    return [line for line in lines if line]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--sass", action="store_true", help="compare the instructions of kernels whose sections differ")
    p.add_argument("--mask-params", action="store_true",
                   help="with --sass: read every kernel-parameter operand as one (a field added to Params)")
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
    if args.sass and differing:
        nvdisasm = find_nvdisasm()
        if nvdisasm is None:
            raise SystemExit("--sass needs nvdisasm (the CUDA toolkit's, or the nvidia-cuda-nvdisasm wheel)")
        changed = {}
        for key in sorted(differing):
            sa, sb = sass(a[key], nvdisasm, args.mask_params), sass(b[key], nvdisasm, args.mask_params)
            if sa != sb:
                changed[key] = sum(x != y for x, y in zip(sa, sb)) + abs(len(sa) - len(sb))
        print(f"instructions: {len(differing) - len(changed)} of the {len(differing)} the same, {len(changed)} differ")
        for key, lines in sorted(changed.items())[:20]:
            print(f"  {key}: {lines} of its instruction lines")
        return 1 if changed else 0
    return 1 if differing or not shared else 0


if __name__ == "__main__":
    sys.exit(main())
