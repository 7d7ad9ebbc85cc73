"""bench/same_code.py tells an edit that only moves source lines from one that changes the machine code (CPU only)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from same_code import code_sections  # noqa: E402

from fusednorm.codegen.nvrtc import compile_to_cubin  # noqa: E402
from fusednorm.codegen.render import render  # noqa: E402
from fusednorm.codegen.spec import KernelSpec, tile_for  # noqa: E402


def test_moved_lines_keep_the_code_and_a_changed_constant_does_not():
    spec = KernelSpec("bf16", 64, "layer", True, True, False, "add", False, tile_for("few_keys", 64), 80, False)
    source = render(spec)
    anchor = "// ---- templates/pnca/statistics.cu ----"
    assert source.count(anchor) == 1 and source.count("#define LOG2E_F 1.4426950408889634f") == 1
    moved = source.replace(anchor, "// one line\n// and another, moving every line below\n" + anchor)
    # the additive mask is scaled by log2(e): another value is another immediate in the code
    changed = source.replace("#define LOG2E_F 1.4426950408889634f", "#define LOG2E_F 1.25f")

    cubins = [compile_to_cubin(s, spec.key, spec.arch)[0] for s in (source, moved, changed)]
    assert cubins[0] != cubins[1], "-lineinfo: moved lines change the cubin's bytes"
    base = code_sections(cubins[0])
    assert any(name.startswith(".text.") for name in base)
    assert code_sections(cubins[1]) == base
    assert code_sections(cubins[2]) != base
