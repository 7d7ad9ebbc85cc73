"""Static SASS census of generated kernels, on a machine without a GPU: registers, spills and instruction counts.

    python bench/sass_census.py [--keys d40,few_keys] [--against DIR] [--nvdisasm PATH]

Each kernel of the list below (one per head dim x tile role x arch, LayerNorm with gamma and beta, no mask) is
compiled with NVRTC into a scratch cache and disassembled with nvdisasm (the CUDA toolkit's, or the one in the
``nvidia-cuda-nvdisasm`` wheel). ``--against DIR`` compiles the same specs from another checkout's ``fusednorm``
(e.g. ``git archive main fusednorm | tar -x -C /tmp/base``) in a subprocess and prints both columns. Static counts
are not executed counts (a loop body counts once), but the main loop's blocks dominate what a warp executes per
head (docs/PERF.md, seventeenth run), so a change that removes instructions there shows up here before any GPU run.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIMS = (32, 40, 64, 80, 96, 128)
ROLES = ("few_keys", "base", "long", "short")
ARCHS = (90, 80)


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for site in sys.path:  # the nvidia-cuda-nvdisasm wheel puts it under nvidia/cu*/bin
        hits = glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "nvdisasm"))
        if hits:
            return hits[0]
    return None


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    """nvdisasm -c of a cubin: one instruction per line, each after its address comment."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def census(tree: Path, nvdisasm: str, keys: list[str]) -> dict[str, tuple[int, int, int]]:
    """{spec key without its tile token: (registers, spill bytes, SASS instructions)} for the tree's fusednorm."""
    sys.path.insert(0, str(tree))
    from fusednorm.codegen import cache
    from fusednorm.codegen.spec import KernelSpec, tile_for

    out, scratch = {}, Path(tempfile.mkdtemp(prefix="sass_census_"))
    for arch in ARCHS:
        for d in HEAD_DIMS:
            for role in ROLES:
                spec = KernelSpec("bf16", d, "layer", True, True, False, "none", False, tile_for(role, d, arch), arch,
                                  False)
                name = f"{role}_d{d}_sm{arch}"
                if keys and not all(k in name or k in spec.key for k in keys):
                    continue
                kernel = cache.get_kernel(spec, scratch)
                sass = disassemble(kernel.cubin, nvdisasm)
                count = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
                out[f"{name} {spec.tile.token}"] = (kernel.usage.registers, kernel.usage.spill_stores, count)
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="", help="comma-separated substrings every listed kernel must contain")
    ap.add_argument("--against", default=None, help="another checkout's root (holding fusednorm/) to compare with")
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the --against subprocess's output
    args = ap.parse_args()
    nvdisasm = args.nvdisasm or find_nvdisasm()
    if nvdisasm is None:
        sys.exit("nvdisasm not found: install the CUDA toolkit or the nvidia-cuda-nvdisasm wheel, or pass --nvdisasm")
    keys = [k for k in args.keys.split(",") if k]
    here = census(ROOT, nvdisasm, keys)
    if args.json:
        print(json.dumps(here))
        return
    there = {}
    if args.against:
        cmd = [sys.executable, str(Path(args.against) / "bench" / "sass_census.py"), "--json", "--nvdisasm", nvdisasm]
        if not (Path(args.against) / "bench" / "sass_census.py").exists():  # an older tree: run this file on it
            cmd = [sys.executable, __file__, "--json", "--nvdisasm", nvdisasm]
        env = dict(os.environ, SASS_CENSUS_ROOT=str(Path(args.against).resolve()))
        there = json.loads(subprocess.run(cmd + (["--keys", args.keys] if keys else []), capture_output=True,
                                          text=True, check=True, env=env).stdout.splitlines()[-1])
    for name, (regs, spills, count) in here.items():
        base = next((v for k, v in there.items() if k.split()[0] == name.split()[0]), None)
        was = f"   was {base[2]:5d} ({base[0]} registers)" if base else ""
        print(f"{name:42s} {regs:3d} registers {spills:3d} spill bytes {count:5d} instructions{was}")


if __name__ == "__main__":
    if os.environ.get("SASS_CENSUS_ROOT"):
        ROOT = Path(os.environ["SASS_CENSUS_ROOT"])
    main()
