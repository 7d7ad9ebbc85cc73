"""The benchmark harness (bench/bench_block.py, bench/models.py) on the CPU: shape tables, byte and FLOP counts,
the forms' eager blocks against the reference, and the timing arithmetic with a stand-in for CUDA."""
from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch

from fusednorm.reference import reference_pre_norm_cross_attn

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name, file):
    spec = importlib.util.spec_from_file_location(name, BENCH / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bb = _load("bench_block", "bench_block.py")
TINY = (2, 5, 32, 4, 7)  # B, Lq, D, H, Lk


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("form", sorted(bb.FORMS))
def test_every_shape_has_a_target(form):
    f = bb.FORMS[form]
    assert f.shapes and set(f.shapes) == set(f.target_us) or form == "noproj_padded" and not f.target_us
    for B, Lq, D, H, Lk in f.shapes.values():
        assert D % H == 0


def test_shape_tables():
    assert bb.SHAPES is bb.NoProjForm.shapes  # bench/profile_kernel.py imports SHAPES
    assert bb.NoProjForm.shapes["seed"] == (32, 2048, 1024, 16, 77) and bb.NoProjForm.target_us["seed"] == 80
    assert bb.NoProjForm.target_us["seed_lk2048"] == 1240
    proj = {n: (bb.ProjForm.shapes[n], bb.ProjForm.target_us[n]) for n in bb.ProjForm.shapes}
    assert proj == {
        "seed": ((32, 2048, 1024, 16, 77), 450), "sdxl64": ((2, 4096, 640, 10, 77), 29),
        "sdxl32": ((2, 1024, 1280, 20, 77), 28), "sd15_64": ((8, 4096, 320, 8, 77), 40),
        "whisper_pre": ((16, 448, 1280, 20, 1500), 190), "whisper_dec": ((64, 1, 1280, 20, 1500), 125),
        "t5_dec": ((32, 128, 1024, 16, 512), 45)}


def test_expects_kernel():
    assert bb.NoProjForm().expects_kernel(bb.NoProjForm.shapes["seed"])
    assert bb.ProjForm().expects_kernel(bb.ProjForm.shapes["seed"])


def test_proj_bytes_and_flops_by_hand():
    B, Lq, D, H, Lk = TINY
    f = bb.ProjForm()
    x = y = 2 * 5 * 32                   # elements of x, of y
    kv = 2 * (2 * 7 * 32)                # k and v
    weights = 2 * 32 * 32 + 4 * 32       # Wq, Wo; gamma, beta, bq, bo
    assert f.bytes_moved(TINY, torch.bfloat16) == 2 * (x + y + kv + weights)
    assert f.bytes_moved(TINY, torch.float32) == 4 * (x + y + kv + weights)
    gemm = 2 * (2 * 5) * 32 * 32         # one projection: 2 * rows * D * D
    attn = 2 * (2 * 2 * 4 * 5 * 7 * 8)   # QK^T and PV: 2 * B * H * Lq * Lk * d each
    assert f.flops(TINY) == 2 * gemm + attn


def test_padded_form_masks_a_prefix_of_at_least_three_quarters_of_the_keys_per_batch_item():
    """noproj_padded: the noproj block with a bool key-padding mask [B, 1, 1, Lk]; eager applies it (a key past an
    item's prefix changes nothing), and its bytes are noproj's plus one per mask element."""
    f, shape = bb.PaddedForm(), (6, 5, 32, 4, 40)
    t = f.make_inputs(shape, torch.float32, torch.Generator().manual_seed(0))
    m = t["mask"]
    assert m.dtype == torch.bool and m.shape == (6, 1, 1, 40)
    kept = m[:, 0, 0].sum(1)
    assert (kept >= 30).all() and torch.equal(m[:, 0, 0], torch.arange(40)[None, :] < kept[:, None])
    short = int(kept.argmin())
    assert kept[short] < 40  # (seeded) some keys of that item are masked, so the check below can fail
    v2 = t["v"].clone()
    v2[short, :, int(kept[short]):] = 1e3  # values of masked keys: no effect
    assert torch.equal(f.eager(**{**t, "v": v2}), f.eager(**t))
    assert f.bytes_moved(shape, torch.bfloat16) == bb.NoProjForm().bytes_moved(shape, torch.bfloat16) + 6 * 40
    assert set(f.shapes) <= set(bb.NoProjForm.shapes) and f.flops(shape) == bb.NoProjForm().flops(shape)


def test_noproj_bytes_and_flops_unchanged():
    B, Lq, D, H, Lk = TINY
    f = bb.NoProjForm()
    assert f.bytes_moved(TINY, torch.bfloat16) == 2 * (2 * B * Lq * D + 2 * B * Lk * D + 2 * D)
    assert f.flops(TINY) == 4 * B * Lq * Lk * D


def test_proj_inputs():
    t = bb.ProjForm().make_inputs(TINY, torch.float32, torch.Generator().manual_seed(0))
    B, Lq, D, H, Lk = TINY
    assert t["k"].shape == t["v"].shape == (B, H, Lk, D // H)
    assert t["wq"].shape == t["wo"].shape == (D, D) and t["bq"].shape == t["bo"].shape == (D,)
    assert 0.5 < float(t["wq"].std() * D**0.5) < 1.5  # std 1/sqrt(D)


def test_proj_eager_matches_reference_and_op():
    f = bb.ProjForm()
    t = f.make_inputs(TINY, torch.float32, torch.Generator().manual_seed(0))
    y = f.eager(**t)
    ref = reference_pre_norm_cross_attn(t["x"], t["k"], t["v"], t["gamma"], t["beta"], t["wq"], t["bq"], t["wo"],
                                        t["bo"], None, "layer", 1e-5, None)
    assert rel_l2(y, ref) < 1e-5
    assert rel_l2(f.fused(**t), y) < 1e-5  # torch.ops.fusednorm.pre_norm_cross_attn, CPU = the reference


def test_noproj_eager_matches_reference():
    f = bb.NoProjForm()
    t = f.make_inputs(TINY, torch.float32, torch.Generator().manual_seed(0))
    ref = reference_pre_norm_cross_attn(t["x"], t["k"], t["v"], t["gamma"], t["beta"], None, None, None, None,
                                        None, "layer", 1e-5, None)
    assert rel_l2(f.eager(**t), ref) < 1e-5


def test_spin_and_window_sizes():
    assert bb.spin_cycles(50, 1_980_000) == 99_000  # kHz clock: 50 µs at 1.98 GHz
    assert bb.spin_cycles(50, None) == bb.spin_cycles(50, 0) == 100_000
    assert bb.replays_per_window(30.0) == 7  # 7 * 30 µs >= 200 µs
    assert bb.replays_per_window(500.0) == 1
    assert bb.replays_per_window(0.0) == 1000  # bounded


class _FakeCuda:
    """Stands in for torch.cuda: each graph replay takes ``replay_ms`` of GPU time; events read the replay count."""

    def __init__(self, replay_ms):
        self.replay_ms, self.replays, self.sleeps = replay_ms, 0, []
        fake = self

        class Graph:
            def replay(self):
                fake.replays += 1

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = fake.replays

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.at - self.at) * fake.replay_ms

        class Props:
            clock_rate = 1_000_000  # kHz

        self.CUDAGraph, self.Event = Graph, Event
        self.synchronize = lambda: None
        self.graph = lambda g: _NullContext()
        self.get_device_properties = lambda i: Props()
        self._sleep = self.sleeps.append


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_graph_time_us_divides_by_replays_and_sets(monkeypatch):
    fake = _FakeCuda(replay_ms=0.030)  # 30 µs per replay of 3 calls -> 10 µs per call
    monkeypatch.setattr(bb.torch, "cuda", fake)
    calls = []
    per_call = bb.graph_time_us(lambda **kw: calls.append(kw), [{"i": 0}, {"i": 1}, {"i": 2}])
    assert per_call == pytest.approx(10.0)
    assert len(calls) == 6  # warm-up and capture, one call per input set each
    assert fake.sleeps and all(c >= 50_000 for c in fake.sleeps)  # >= 50 µs at 1 GHz before every window
    assert fake.replays >= 8 + 10 * 7  # calibration, then >= 10 windows of 7 replays (>= 200 µs each)


def test_models_skip_a_missing_library(monkeypatch, capsys):
    models = _load("bench_models", "models.py")
    monkeypatch.setitem(models.LIBRARY, "unet", "no_such_library_xyz")
    monkeypatch.setattr(models, "bench_one", lambda *a, **k: pytest.fail("a skipped model must not be built"))
    rows = models.run_models(["unet"], "cpu", torch.float32)
    assert rows == [{"model": "unet", "skipped": "needs no_such_library_xyz, which is not installed"}]
    assert "skipping unet" in capsys.readouterr().out


def test_models_saves_after_each_model(monkeypatch):
    """A run cut short by its time limit keeps every model it finished: rows are saved after each one."""
    models = _load("bench_models", "models.py")
    monkeypatch.setattr(models, "bench_one", lambda name, *a: {"model": name, "eager_ms": 1.0})
    monkeypatch.setattr(models, "LIBRARY", {})
    saved = []
    rows = models.run_models(["torch", "whisper"], "cpu", torch.float32, save=lambda r: saved.append(list(r)))
    assert saved == [rows[:1], rows] and [r["model"] for r in rows] == ["torch", "whisper"]


def test_sass_profile_groups_an_ncu_sass_page():
    sp = _load("sass_profile", "sass_profile.py")
    page = ('"Kernel Name","pnca_bf16_d64",\n'
            '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"Instructions Executed"\n'
            '"0x10","      LDC R1, c[0x0][0x28]","3","3","8"\n'
            '"0x20","      HMMA.16816.F32.BF16 R4, R8, R12, RZ","10","9","64"\n'
            '"0x30","@P0   HMMA.16816.F32.BF16 R4, R8, R12, R4","5","5","64"\n'
            '"0x40","      SHF.L.U32 R14, R12, 0x10, RZ","40","40","32"\n')
    instrs = sp.read_sass_csv(page)
    assert [i.opcode for i in instrs] == ["LDC", "HMMA", "HMMA", "SHF"]  # the predicate guard is not the opcode
    assert sp.opcode_mix(instrs) == [("HMMA", 128, 15), ("SHF", 32, 40), ("LDC", 8, 3)]
    assert sp.by_execution_count(instrs) == [(64, 2, 128), (32, 1, 32), (8, 1, 8)]


def test_stall_reasons_reads_the_raw_page():
    sr = _load("bench_stall_reasons", "stall_reasons.py")
    names = ['"ID"', '"Kernel Name"', '"smsp__pcsamp_warps_issue_stalled_barrier"',
             '"smsp__pcsamp_warps_issue_stalled_long_scoreboard"', '"smsp__pcsamp_warps_issue_stalled_wait"',
             '"smsp__pcsamp_warps_issue_stalled_wait_not_issued"']
    page = "\n".join([",".join(names), '"","","","","",""', '"0","pnca","1,000","3,000","4,000","9"'])
    shares = sr.stall_shares(page)
    assert [r for r, _ in shares] == ["wait", "long_scoreboard", "barrier"]
    assert shares[0][1] == pytest.approx(0.5) and sum(v for _, v in shares) == pytest.approx(1.0)
    averages = page.replace("smsp__pcsamp_warps_issue_stalled_", "smsp__average_warps_issue_stalled_").replace(
        '_barrier"', '_barrier_per_issue_active.ratio"').replace('_scoreboard"', '_scoreboard_per_issue_active.ratio"')
    assert [r for r, _ in sr.stall_shares(averages)] == ["long_scoreboard", "barrier"]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("role", ["few_keys", "long"])  # the one-tile kernels, and with --all-roles the others
@pytest.mark.parametrize("d", [64, 40])
def test_every_ablation_cut_applies_to_each_kernel(arch, role, d, monkeypatch):
    """bench/ablate_kernel.py edits the rendered source: each cut must match it exactly once (mma.sync and wgmma
    text alike), and the cut kernel must still compile."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusednorm.codegen.nvrtc import compile_to_cubin
    from fusednorm.codegen.render import render
    from fusednorm.codegen.spec import KernelSpec, tile_for

    monkeypatch.setenv("FUSEDNORM_CACHE_DIR", "unused")  # the module points the cache elsewhere on import
    sys.path.insert(0, str(BENCH))
    try:
        ab = _load("ablate_kernel", "ablate_kernel.py")
    finally:
        sys.path.remove(str(BENCH))
    spec = KernelSpec("bf16", d, "layer", True, True, False, "none", False, tile_for(role, d, arch), arch, False)
    source = render(spec)
    for name, (_, edits) in ab.CUTS.items():
        cut = source
        for old, new in edits:
            assert cut.count(old) == 1, f"cut {name}: {old!r}"
            cut = cut.replace(old, new)
        if name in ("no_qk_mma", "no_pv_mma"):
            assert cut != source
            compile_to_cubin(cut, spec.key, spec.arch)
    ws = tile_for("many_keys", 64, 90, warp_specialised=True)
    ws_spec = KernelSpec("bf16", 64, "layer", True, True, False, "none", False, ws, 90, False)
    for name, (_, edits) in ab.VARIANTS.items():  # what --variants times must build, and change the source
        target, text = spec, source
        if name.startswith("ws_"):  # the warp-specialised kernel's variants, and only its
            assert ab.edited_render(lambda _: source, name, edits, all_roles=True)(spec) == source, name
            if (arch, role, d) != (90, "long", 64):
                continue
            target, text = ws_spec, render(ws_spec)
        variant = ab.edited_render(lambda _, t=text: t, name, edits, all_roles=True)(target)
        assert variant != text, name
        if any("cache_hint" in new for _, new in edits):  # an L2-policy variant: its loads or stores carry the hint
            assert variant.count("cache_hint") > text.count("cache_hint"), name
        _, usage, _ = compile_to_cubin(variant, target.key, target.arch)
        assert usage.spill_stores == usage.spill_loads == 0, (name, usage)


def test_copy_probe_builds_every_copy_form_without_spills_and_sizes_shared_memory_for_the_occupancy_asked():
    pytest.importorskip("cuda.bindings.nvrtc")
    from fusednorm.codegen.nvrtc import compile_to_cubin

    probe = _load("probe_copies", "probe_copies.py")
    for form in probe.FORMS:
        for stages in (3, 4):
            _, usage, _ = compile_to_cubin(probe.source(form, stages), "probe_copies", 90)
            assert usage.spill_stores == usage.spill_loads == 0 and usage.registers <= 128, (form, stages, usage)
    for stages in (3, 4):
        for ctas in (2, 3, 4):
            smem = probe.smem_bytes(stages, ctas)
            assert smem >= stages * probe.STAGE_BYTES
            per_cta = smem + 1024
            if stages * probe.STAGE_BYTES * ctas < probe.SMEM_PER_SM - ctas * 1024:  # the stages leave room
                assert ctas * per_cta <= probe.SMEM_PER_SM < (ctas + 1) * per_cta


def test_attention_probe_variants_compile_without_spills_or_serialized_wgmma():
    """bench/probe_attention.cu: every variant, as plain attention and as the fused block (statistics inline or
    ahead), compiles for sm_90 with no spills, its warpgroup mma left asynchronous (ptxas says when it serializes
    them or injects waits), and its shared memory as the launch asks."""
    pytest.importorskip("cuda.bindings.nvrtc")
    probe = _load("probe_attention", "probe_attention.py")
    variants = probe.VARIANTS.items()
    for (name, (_, _, stages, block_n, consumers)), mode in itertools.product(variants, probe.MODE_LABELS):
        _, usage, log_text = probe.compile_variant(name, mode)
        assert usage.spill_stores == usage.spill_loads == 0, (name, mode, usage)
        assert usage.registers <= 65536 // (128 * (consumers + 1)), (name, usage)  # launch bounds: 1 CTA per SM
        assert "C7514" not in log_text and "C7517" not in log_text, (name, mode, log_text)
        assert probe.smem_bytes(stages, block_n, consumers) <= 227 * 1024
    for (consumers, _), (producer_regs, consumer_regs) in probe.REGS.items():
        assert 128 * producer_regs + 128 * consumers * consumer_regs <= 64 * 1024


def test_kernel_choice_shapes_straddle_the_ridge_and_their_comments_say_their_intensity():
    """bench/kernel_choice.py must time shapes on both sides of kernel="auto"'s ridge; each shape's comment gives
    its FLOP/byte as fusednorm computes it."""
    import re
    import types

    from fusednorm.plans import choose

    kernel_choice = _load("kernel_choice", "kernel_choice.py")

    def fake(*shape):
        return types.SimpleNamespace(shape=shape, dtype=torch.bfloat16)

    source = Path(kernel_choice.__file__).read_text()
    intensity, commented = {}, 0
    for name, (B, Lq, D, H, Lk) in kernel_choice.SHAPES.items():
        d = D // H
        intensity[name] = choose.flop_per_byte(dict(x=fake(B, Lq, D), k=fake(B, H, Lk, d), v=fake(B, H, Lk, d),
                                                    mask=None))
        said = re.search(rf'"{name}": \([^)]*\),\s*# (\d+)', source)
        if said:
            commented += 1
            assert int(said.group(1)) == round(intensity[name]), name
    assert commented == len(kernel_choice.SHAPES) - len(bb.NoProjForm.shapes)  # the added shapes say theirs
    below = [n for n, i in intensity.items() if i <= choose.RIDGE_FLOP_PER_BYTE]
    above = [n for n, i in intensity.items() if i > choose.RIDGE_FLOP_PER_BYTE]
    assert len(below) >= 3 and len(above) >= 3, intensity


def test_models_cuda_graph_variants_use_valid_options():
    """The three CUDA-graph variants (Inductor's reduce-overhead, fusednorm's option cudagraphs, measured and
    forced) are there unless switched off, and their options pass the backend's checks."""
    from fusednorm.options import Options
    from fusednorm.report import Report

    models = _load("bench_models", "models.py")
    reports = {key: Report() for key in models.REPORTS}
    kws = {label: kw for label, _, kw in models.variants(reports)}
    assert {"inductor_cg", "fusednorm_measure_cg", "fusednorm_plan_cg"} <= set(kws)
    assert kws["inductor_cg"] == {"mode": "reduce-overhead"}
    assert kws["fusednorm_measure_cg"]["options"]["report"] is reports["measure_cg"]
    for kw in kws.values():
        if "options" in kw:
            Options.from_dict(kw["options"])
    assert all(opts.cudagraphs for label, kw in kws.items() if label.startswith("fusednorm") and label.endswith("_cg")
               for opts in [Options.from_dict(kw["options"])])
    assert not any(label.endswith("_cg") for label, _, _ in models.variants(reports, cudagraphs=False))


def test_models_tables_print_a_run_that_left_variants_out(capsys):
    """--variants: the tables read "—" where a variant did not run, instead of failing at the end of a long run."""
    models = _load("bench_models", "models.py")
    row = {"model": "t5", "title": "T5", "eager_ms": 6.0, "eager_graph_ms": 5.0, "inductor_ms": 5.5,
           "inductor_graph_ms": 5.1, "inductor_cg_ms": 5.2, "fusednorm_plan_cg_ms": 4.8,
           "fusednorm_plan_cg_rel_l2_vs_eager": 1e-2, "fused_blocks": 0, "plan_blocks": 12, "measure_plan_blocks": 0}
    models.print_tables({"device": "test"}, [row, {"model": "unet", "skipped": "needs diffusers"}])
    out = capsys.readouterr().out
    assert "| T5 | 5.00 (call 6.00) | 5.10 (call 5.50) | — | — |" in out
    assert "| T5 | 5.20 | —, — | 4.80 | 1.00e-02 |" in out
    assert "| unet | skipped: needs diffusers |" in out


def test_prebuilt_kernels_are_the_ones_the_gpu_tests_compile():
    """bench/prebuild_kernels.py and the GPU kernel tests' up-front compile share one list (tests/gpu/
    kernel_specs.py): every (dtype, head dim, tile role) with each norm and mask, the sm_80 tiles too on sm_90,
    the numerics-check, float32-mask, float32-parameter and gamma-only kernels, and on sm_90 the bulk-copy tiles'
    twins; each key once. Beside them, the plan tests' stages."""
    sys.path.insert(0, str(BENCH.parent / "tests" / "gpu"))
    try:
        from kernel_specs import kernel_test_specs, plan_test_specs
    finally:
        sys.path.pop(0)
    from fusednorm.codegen.spec import HEAD_DIMS, TILE_ROLES, tile_for

    for arch in (80, 90):
        specs = kernel_test_specs(arch)
        keys = [s.key for s in specs]
        assert len(keys) == len(set(keys)) and all(s.arch == arch for s in specs)
        tiles = {(s.dtype, s.head_dim, s.tile) for s in specs}
        assert all((dt, d, tile_for(r, d, arch)) in tiles for dt in ("bf16", "fp16") for d in HEAD_DIMS
                   for r in TILE_ROLES)
        assert {(s.norm, s.has_gamma, s.has_beta, s.mask) for s in specs if s.dtype == "fp16" and s.head_dim == 40} \
            == {(n, g, b, m) for n, g, b in (("layer", True, True), ("layer", False, False), ("rms", True, False))
                for m in ("none", "bool", "add")}
        assert any(s.check_numerics for s in specs) and any(s.mask_f32 for s in specs)
        assert any(s.affine_f32 for s in specs) and any(s.has_gamma and not s.has_beta and s.norm == "layer"
                                                        for s in specs)
    on_sm90 = {s.tile for s in kernel_test_specs(90)}
    assert any(t.wgmma and not t.tma for t in on_sm90)  # the bulk-copy tiles' twins without bulk copies
    assert {tile_for("long", 64, 90), tile_for("long", 64, 80)} <= on_sm90  # the sm_80 tiles are tested there too
    stages = plan_test_specs(90)
    assert len({s.key for s in stages}) == len(stages) and not {s.key for s in stages} & {s.key for s in specs}
    flavours = {(s.q_from_qraw, s.write_o, s.has_gamma) for s in stages if s.head_dim == 64}
    assert flavours == {(True, True, False), (True, False, False), (False, True, True)}  # norm folded with Wq
    assert {s.head_dim for s in stages} == {40, 64, 80, 128, 160}


def test_host_dispatch_times_both_autograd_kernels_and_leaves_the_op_as_it_was(capsys):
    from fusednorm import op

    hd = _load("host_dispatch", "host_dispatch.py")
    hd.main(["--windows", "1", "--calls", "50"])
    out = capsys.readouterr().out
    assert "fusednorm's autograd kernel" in out and "custom_op's autograd kernel" in out
    assert op.DEVICE_IMPLS[torch._C.DispatchKey.CPU] is op._pre_norm_cross_attn_reference
    x, k = torch.randn(1, 2, 8), torch.randn(1, 2, 3, 4)
    y = torch.ops.fusednorm.pre_norm_cross_attn(x, k, k, None, None, None, None, None, None, None, "layer", 1e-5)
    torch.testing.assert_close(y, reference_pre_norm_cross_attn(x, k, k, None, None, None, None, None, None, None,
                                                                "layer", 1e-5, None))
