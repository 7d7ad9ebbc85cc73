"""Compile, on a machine without a GPU, the kernels the GPU tests need, into a kernel cache for the device.

    python bench/prebuild_kernels.py --arch 90 --out /tmp/fnk --pack .kernels.tar.xz

On the device their cold compiles take ~200 s of the GPU suite's ~250 (docs/PERF.md, tenth run: 48 s with the
kernels cached). NVRTC runs without a GPU, so they can be compiled here and carried (`run(carry=
[".kernels.tar.xz"])`); `bench/device_run.sh` unpacks the file into the kernel cache of every step (a kernel
the pack lacks is compiled there with the device's NVRTC). A cache entry is used only if its fingerprint matches: the
kernel source, the NVRTC options and the NVRTC major.minor version. The H200 machines had NVRTC 13.0
(docs/PERF.md), so compile with that version, e.g. in a virtual environment of its own that sees this one's
packages:

    python3 -m venv /tmp/venv130 && /tmp/venv130/bin/pip install -q --no-deps "nvidia-cuda-nvrtc==13.0.*"
    python -c "import site; print(site.getsitepackages()[0])" \\
        > "$(/tmp/venv130/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_main.pth"
    /tmp/venv130/bin/python bench/prebuild_kernels.py --arch 90 --pack .kernels.tar.xz
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

from fusednorm.codegen import cache, nvrtc  # noqa: E402
from kernel_specs import kernel_test_specs, plan_test_specs  # noqa: E402


def _build(args):
    spec, directory = args
    kernel = cache.get_kernel(spec, Path(directory))
    return spec.key, kernel.from_disk, kernel.usage.spill_stores


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--out", default="/tmp/fnk", help="the kernel cache folder to fill")
    p.add_argument("--pack", default=None, help="also write these kernels' entries into this .tar.xz")
    p.add_argument("--pack-compiled-only", action="store_true",
                   help="pack only the entries this run compiled: a variant tree's overlay on main's pack, built in "
                        "a copy of main's cache folder (device_run.sh's abblock step)")
    p.add_argument("--match", default=None,
                   help="only the kernels whose key this regular expression finds, e.g. a variant tree's benchmark "
                        "kernels (bench/make_ab_trees.sh)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--expect-nvrtc", default="13.0", help="warn when the NVRTC loaded here is another version")
    args = p.parse_args()
    version = nvrtc.nvrtc_version()
    print(f"NVRTC {version} (the device's entries must come from the version it runs)", flush=True)
    if version != args.expect_nvrtc:
        print(f"warning: NVRTC {version} here, {args.expect_nvrtc} expected: the device will not use these entries",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = list({s.key: s for s in kernel_test_specs(args.arch) + plan_test_specs(args.arch)}.values())
    if args.match:
        specs = [s for s in specs if re.search(args.match, s.key)]
        if not specs:
            raise SystemExit(f"no kernel key matches {args.match!r}")
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        built = list(pool.map(_build, [(s, str(out)) for s in specs], chunksize=4))
    cached = sum(1 for _, from_disk, _ in built if from_disk)
    spilling = [key for key, _, spills in built if spills]
    print(f"{len(built)} kernels for sm_{args.arch} in {time.time() - t0:.0f} s ({cached} were cached already)"
          + (f"; spilling: {spilling}" if spilling else ""), flush=True)
    if args.pack:  # written beside it, then renamed: a file that exists is whole (packing takes minutes)
        entries = sorted(cache.entry_path(s, out) for s, (_, from_disk, _) in zip(specs, built)
                         if not (args.pack_compiled_only and from_disk))  # not the folder's other entries, if any
        print(f"packing {len(entries)} entries into {args.pack} ...", flush=True)
        partial = Path(f"{args.pack}.partial")
        with tarfile.open(partial, "w:xz", preset=6) as tar:
            for path in entries:
                tar.add(path, arcname=path.name)
        os.replace(partial, args.pack)
        size = sum(path.stat().st_size for path in entries)
        print(f"{args.pack}: {len(entries)} entries, {size / 2**20:.0f} MiB -> "
              f"{Path(args.pack).stat().st_size / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
