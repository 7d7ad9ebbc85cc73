"""bench/same_code.py tells an edit that only moves source lines from one that changes the machine code (CPU only)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from same_code import code_sections, sass  # noqa: E402
from sass_census import find_nvdisasm  # noqa: E402

from fusednorm.codegen.nvrtc import compile_to_cubin  # noqa: E402
from fusednorm.codegen.render import render  # noqa: E402
from fusednorm.codegen.spec import KernelSpec, tile_for  # noqa: E402

# one kernel for every test here: the few-key tile with LayerNorm, gamma, beta and an additive mask (sm_80)
SPEC = KernelSpec("bf16", 64, "layer", True, True, False, "add", False, tile_for("few_keys", 64), 80, False)


def test_moved_lines_keep_the_code_and_a_changed_constant_does_not():
    source = render(SPEC)
    anchor = "// ---- templates/pnca/statistics.cu ----"
    assert source.count(anchor) == 1 and source.count("#define LOG2E_F 1.4426950408889634f") == 1
    moved = source.replace(anchor, "// one line\n// and another, moving every line below\n" + anchor)
    # the additive mask is scaled by log2(e): another value is another immediate in the code
    changed = source.replace("#define LOG2E_F 1.4426950408889634f", "#define LOG2E_F 1.25f")

    cubins = [compile_to_cubin(s, SPEC.key, SPEC.arch)[0] for s in (source, moved, changed)]
    assert cubins[0] != cubins[1], "-lineinfo: moved lines change the cubin's bytes"
    base = code_sections(cubins[0])
    assert any(name.startswith(".text.") for name in base)
    assert code_sections(cubins[1]) == base
    assert code_sections(cubins[2]) != base


def test_sass_mode_sees_through_a_new_constant_but_not_a_changed_instruction():
    """--sass: a configuration constant that no instruction reads changes the constant tables, not the code."""
    nvdisasm = find_nvdisasm()
    assert nvdisasm is not None, "the test extra installs nvidia-cuda-nvdisasm"
    source = render(SPEC)
    assert source.count("#define KERNEL_NAME") == 1
    extra = source.replace("#define KERNEL_NAME", "constexpr int UNUSED_SETTING = 7;\n#define KERNEL_NAME")
    changed = source.replace("#define LOG2E_F 1.4426950408889634f", "#define LOG2E_F 1.25f")
    base, with_constant, other = (compile_to_cubin(s, SPEC.key, SPEC.arch)[0] for s in (source, extra, changed))
    assert code_sections(with_constant) != code_sections(base)
    assert sass(with_constant, nvdisasm) == sass(base, nvdisasm)
    assert sass(other, nvdisasm) != sass(base, nvdisasm)


def test_mask_params_sees_through_a_field_added_to_params():
    """--mask-params: a field added to struct Params after its pointers moves the offsets of the fields after it
    (so the instructions differ as text) and changes nothing else."""
    nvdisasm = find_nvdisasm()
    source = render(SPEC)
    size = int(re.search(r"static_assert\(sizeof\(Params\) == (\d+),", source).group(1))
    assert source.count("  long long k_sb, k_sh, k_sl;\n") == 1
    wider = source.replace("  long long k_sb", "  const void* unused_field;\n  long long k_sb").replace(
        f"sizeof(Params) == {size},", f"sizeof(Params) == {size + 8},")
    base, moved = (compile_to_cubin(s, SPEC.key, SPEC.arch)[0] for s in (source, wider))
    assert sass(moved, nvdisasm) != sass(base, nvdisasm)
    assert sass(moved, nvdisasm, mask_params=True) == sass(base, nvdisasm, mask_params=True)
