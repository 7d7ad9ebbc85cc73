"""bench/variants/*.patch, the kernel experiments that bench/make_ab_trees.sh turns into trees for device_run.sh's
abblock step, still apply to the templates, and each one's warp-specialised kernel still compiles (NVRTC, sm_90)
without spills and with its wgmma left asynchronous: a stale patch would otherwise be found only on the device,
where the time is short."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusednorm.codegen.render import render
from fusednorm.codegen.spec import KernelSpec, tile_for

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "bench" / "variants").glob("*.patch"))

# The Lk 2048 block's kernel: bf16, LayerNorm with gamma and beta, no mask (then the many_keys warp-specialised
# tile, sm_90, no numerics check)
SPEC_ARGS = ["bf16", 64, "layer", True, True, False, "none", False]


# Run in the patched tree, so that its fusednorm is the one imported
COMPILE = """
import json, sys
sys.path.insert(0, ".")
import fusednorm
from fusednorm.codegen.nvrtc import compile_to_cubin
from fusednorm.codegen.render import render
from fusednorm.codegen.spec import KernelSpec, tile_for
spec = KernelSpec(*json.loads(sys.argv[1]), tile_for("many_keys", 64, 90, warp_specialised=True), 90, False)
source = render(spec)
_, usage, log = compile_to_cubin(source, spec.key, 90)[:3]
print(json.dumps({"module": fusednorm.__file__, "source": source,
                  "spills": usage.spill_stores + usage.spill_loads, "log": log}))
"""


def _compile_in(tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(SPEC_ARGS)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_there_are_variant_patches():
    assert PATCHES, "bench/variants/ holds no patch"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_variant_patch_applies_and_its_kernel_compiles_without_spills(patch, tmp_path):
    tree = tmp_path / "tree"
    for part in ("fusednorm", "bench", "tests"):  # what bench/make_ab_trees.sh puts in a tree
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__", "out"))
    applied = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=tree, capture_output=True, text=True)
    assert applied.returncode == 0, f"{patch.name} no longer applies: {applied.stderr}"
    variant = _compile_in(tree)
    assert Path(variant["module"]).resolve().is_relative_to(tree.resolve())  # the patched tree's, not this one's
    tile = tile_for("many_keys", 64, 90, warp_specialised=True)
    base = render(KernelSpec(*SPEC_ARGS, tile, 90, False))  # main's, from this checkout
    assert variant["source"] != base, f"{patch.name} does not change the Lk 2048 kernel"
    assert variant["spills"] == 0, f"{patch.name}: {variant['spills']} bytes of spills"
    assert "instructions are serialized" not in variant["log"], f"{patch.name}: {variant['log']}"  # wgmma: C751x
