"""The projection plan's choice: measured once per shape against the compiler, reported with its numbers."""
from __future__ import annotations

import types

import pytest
import torch

from fusednorm.plans import choose
from fusednorm.plans.choose import Timing


def fake(*shape, dtype=torch.bfloat16, device="cuda"):
    return types.SimpleNamespace(shape=shape, dtype=dtype, device=torch.device(device))


def args(B=2, Lq=64, D=256, H=4, Lk=77, wo=True, wq=True):
    d = D // H
    a = {n: None for n in ("gamma", "beta", "wq", "bq", "wo", "bo", "mask")}
    a.update(x=fake(B, Lq, D), k=fake(B, H, Lk, d), v=fake(B, H, Lk, d), gamma=fake(D), beta=fake(D), eps=1e-5,
             scale=None)
    if wq:
        a.update(wq=fake(D, D), bq=fake(D))
    if wo:
        a.update(wo=fake(D, D), bo=fake(D))
    return a


@pytest.fixture
def measured(monkeypatch):
    calls = []

    def measure(tensors, norm, eps, scale, graph=None):
        calls.append(tuple(tensors["x"].shape))
        fused_us, compiler_us = (50.0, 80.0) if tensors["x"].shape[1] == 64 else (80.0, 79.0)
        return Timing(fused_us, 30.0, compiler_us, 40.0)

    monkeypatch.setattr(choose, "_measure", measure)
    monkeypatch.setattr(choose, "_key", lambda tensors, norm, scale: (norm, scale, tuple(
        None if t is None else tuple(t.shape) for t in tensors.values())))
    monkeypatch.setattr(choose, "_timings", {})
    monkeypatch.setattr(choose, "_arch", lambda x: 90)  # the H200's ridge unless a test says otherwise
    monkeypatch.setattr(choose, "_sm_count", lambda x: 8)  # the small shapes here fill it unless a test says so
    return calls


def test_the_plan_is_taken_only_where_it_measured_faster(measured):
    fast = choose.decide(args(Lq=64), "layer", "measure")
    assert fast.fused and "measured plan 50.0 µs GPU, 30.0 µs host per call vs compiler 80.0 µs GPU" in fast.reason
    slow = choose.decide(args(Lq=65), "layer", "measure")  # 80 vs 79: not faster
    assert not slow.fused and slow.reason.startswith("left to the compiler: not faster")


def test_within_the_noise_margin_the_compiler_keeps_the_block():
    assert not choose._verdict(Timing(78.0, 10.0, 80.0, 40.0)).fused  # 2.5 % faster is inside the 3 % margin
    assert choose._verdict(Timing(70.0, 10.0, 80.0, 40.0)).fused


def test_a_plan_costing_more_host_time_than_the_compilers_block_is_not_taken():
    """In a compiled model the plan's host cost per call is paid in full when the model is host-bound, where the
    GPU time it saves buys nothing (T5-base on the H200: GPU 4.74 ms against 5.15, per call 7.36 against 6.21)."""
    t5 = choose._verdict(Timing(114.1, 168.1, 192.9, 41.0))  # faster on the GPU, 4x the host time
    assert not t5.fused and t5.reason.startswith("left to the compiler: more host time per call (measured plan 114.1")
    assert "168.1 µs host per call vs compiler 192.9 µs GPU, 41.0 µs host" in t5.reason
    assert choose._verdict(Timing(114.1, 30.0, 192.9, 41.0)).fused  # clearly less host time: taken
    assert choose._verdict(Timing(114.1, 168.1, 192.9, 41.0), host_time_counts=False).fused  # CUDA graphs


def test_a_plan_timed_just_under_the_compilers_host_time_is_not_taken():
    """Alone the plan's Python path times faster than in a model: T5-base's block at 0.91 of the compiler's host
    time, and on the plan the host-bound model ran 6.7 % slower per call (H100). It must take at most 3/4."""
    t5 = choose._verdict(Timing(127.2, 212.6, 222.4, 233.2))
    assert not t5.fused and t5.reason.startswith("left to the compiler: more host time per call")
    assert not choose._verdict(Timing(114.1, 41.0, 192.9, 41.0)).fused  # level host time: not taken either
    assert choose._verdict(Timing(180.0, 0.74 * 233.2, 222.4, 233.2)).fused


def test_a_plan_whose_host_time_exceeds_its_gpu_time_is_not_taken():
    """Whisper-base's block (B16, Lq 448, Lk 1500, D 512; H100, docs/PERF.md fortieth run): the plan took 98.2 µs of
    GPU time and 157.0 µs of host time, at 0.71 of the compiler's 220.2, and on the plan the model ran 3.69 ms per
    call against 2.81. A host slower to enqueue the plan than the GPU is to run it falls behind."""
    whisper = choose._verdict(Timing(98.2, 157.0, 106.0, 220.2))
    assert not whisper.fused and whisper.reason.startswith("left to the compiler: host time per call above its GPU")
    assert choose._verdict(Timing(98.2, 157.0, 106.0, 220.2), host_time_counts=False).fused  # CUDA graphs
    assert choose._verdict(Timing(272.4, 157.0, 299.3, 220.2)).fused  # prefill's size: the GPU time covers it


def test_each_shape_is_measured_once(measured):
    for _ in range(3):
        choose.decide(args(Lq=64), "layer", "measure")
    choose.decide(args(Lq=64, wo=False), "layer", "measure")  # another variant: measured separately
    assert measured == [(2, 64, 256), (2, 64, 256)]


def test_the_compiler_is_timed_on_the_models_own_nodes_once_per_code_and_shape(monkeypatch):
    """The block's nodes (a BlockGraph from the match) reach the measurement; blocks of one shape but other code
    (T5's matmul-softmax-matmul against SDPA) are timed apart, and the nodes are copied out only to be timed."""
    graphs, made = [], []
    monkeypatch.setattr(choose, "_measure",
                        lambda t, n, e, s, graph=None: graphs.append(graph) or Timing(50, 30, 80, 40))
    monkeypatch.setattr(choose, "_key", lambda tensors, norm, scale: "one shape")
    monkeypatch.setattr(choose, "_timings", {})

    def block(code):
        return lambda: made.append(code) or types.SimpleNamespace(signature=code)

    for code in ("matmul softmax matmul", "sdpa", "sdpa"):
        assert choose.decide(args(), "layer", "measure", block=block(code)).fused
    assert [g.signature for g in graphs] == ["matmul softmax matmul", "sdpa"]
    choose.decide(args(), "layer", "always", block=block("never copied"))
    assert made == ["matmul softmax matmul", "sdpa", "sdpa"]
    why = choose.decide(args(), "layer", "measure", block=lambda: "an input is not a tensor")  # the canonical block
    assert why.fused and graphs[-1] == "an input is not a tensor"
    monkeypatch.setattr(choose, "_timings", {})
    choose.decide(args(), "layer", "measure", block=lambda: {}["x"])  # a failed copy never fails the match
    assert graphs[-1] == "copying its nodes raised KeyError: 'x'"
    noted = Timing(50, 30, 80, 40, " (on the canonical block: why)")
    monkeypatch.setattr(choose, "_measure", lambda *a: noted)
    monkeypatch.setattr(choose, "_timings", {})
    reason = choose.decide(args(), "layer", "measure").reason
    assert "vs compiler 80.0 µs GPU, 40.0 µs host (on the canonical block: why)" in reason


def test_the_default_option_leaves_blocks_with_projections_to_the_compiler(measured):
    from fusednorm.options import Options

    policy = Options.from_dict({}).plan
    assert policy == "never" and Options().plan == "never"
    assert not choose.decide(args(), "layer", policy).fused and measured == []
    with pytest.raises(ValueError, match="plan='fast'"):
        Options.from_dict({"plan": "fast"})


def test_with_cuda_graphs_the_default_measures_the_plan(measured):
    """Replayed as CUDA graphs, the plan's host cost is paid once: unset, the plan option measures the block."""
    from fusednorm.options import Options

    for given in ({"cudagraphs": True}, {"inductor": {"triton.cudagraphs": True}}, {"cudagraphs": True, "plan": None}):
        assert Options.from_dict(given).plan == "measure", given
    assert Options(cudagraphs=True).plan == "measure"
    assert Options.from_dict({"cudagraphs": True, "plan": "never"}).plan == "never"  # a given option stands
    choose.decide(args(), "layer", Options.from_dict({"cudagraphs": True}).plan, host_time_counts=False)
    assert measured == [(2, 64, 256)]


def test_options_always_and_never_skip_the_measurement(measured):
    assert choose.decide(args(), "layer", "always").fused
    assert not choose.decide(args(), "layer", "never").fused
    assert measured == []
    with pytest.raises(ValueError, match="plan='sometimes'"):
        choose.decide(args(), "layer", "sometimes")


def test_dynamic_shapes_stay_with_the_compiler(measured):
    a = args()
    a["x"] = fake(2, object(), 256)  # a symbolic length
    choice = choose.decide(a, "layer", "measure")
    assert not choice.fused and "dynamic shapes" in choice.reason and measured == []


def test_a_failed_measurement_leaves_the_block_to_the_compiler(monkeypatch):
    def broken(*a):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(choose, "_time_both", broken)
    monkeypatch.setattr(choose, "_key", lambda tensors, norm, scale: "broken")
    monkeypatch.setattr(choose, "_timings", {})
    choice = choose.decide(args(), "layer", "measure")
    assert not choice.fused and "plan could not be measured (RuntimeError: out of memory)" in choice.reason


def test_the_unfused_block_is_the_op_in_eager_torch():
    from fusednorm.reference import reference_pre_norm_cross_attn

    g = torch.Generator().manual_seed(0)
    B, Lq, D, H, Lk = 2, 5, 32, 4, 7
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = dict(x=r(B, Lq, D), k=r(B, H, Lk, D // H), v=r(B, H, Lk, D // H), gamma=1 + 0.1 * r(D), beta=0.1 * r(D),
             wq=r(D, D) / D**0.5, bq=r(D), wo=r(D, D) / D**0.5, bo=r(D), mask=r(B, 1, Lq, Lk))
    for norm in ("layer", "rms"):
        tt = dict(t, beta=None) if norm == "rms" else t
        got = choose.unfused_block(**tt, norm=norm, eps=1e-5, scale=0.3)
        ref = reference_pre_norm_cross_attn(*tt.values(), norm, 1e-5, 0.3)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_projection_free_blocks_run_the_kernel_unless_measuring_is_asked_for(measured):
    """kernel='always' fuses without timing anything; kernel='measure' keeps the kernel only where it measured
    faster than the compiler, and says so with the numbers."""
    from fusednorm.options import Options

    free = args(wq=False, wo=False)
    always = choose.decide(free, "layer", "always")
    assert always.fused and always.reason == "the kernel (option kernel='always')" and measured == []
    fast = choose.decide(free, "layer", "measure")
    assert fast.fused and "measured kernel 50.0 µs GPU, 30.0 µs host per call vs compiler 80.0 µs GPU" in fast.reason
    slow = choose.decide(args(Lq=65, wq=False, wo=False), "layer", "measure")
    assert not slow.fused and slow.reason.startswith("left to the compiler: not faster (measured kernel 80.0")
    with pytest.raises(ValueError, match="kernel='never'"):
        choose.decide(free, "layer", "never")  # rewrite=False is how nothing is fused
    with pytest.raises(ValueError, match="kernel='fast'"):
        Options.from_dict({"kernel": "fast"})


def test_the_default_takes_the_kernel_where_the_block_is_memory_bound_and_times_it_elsewhere(measured):
    """kernel='auto' (the default): a block with few FLOPs per byte moved runs the kernel untimed; a block whose
    attention math outweighs its bytes (where the compiler's SDPA may be faster) is timed, and the reason says why."""
    from fusednorm.options import Options

    assert Options.from_dict({}).kernel == "auto"
    few_keys = choose.decide(args(Lq=64, Lk=77, wq=False, wo=False), "layer", "auto")
    assert few_keys.fused and "memory-bound, 35 FLOP/byte <= 192" in few_keys.reason and measured == []
    long = choose.decide(args(Lq=1024, Lk=1024, wq=False, wo=False), "layer", "auto")
    assert measured == [(2, 1024, 256)]
    assert not long.fused and long.reason.startswith("left to the compiler: not faster (measured kernel 80.0")
    assert long.reason.endswith("(512 FLOP/byte > 192)")
    dynamic = args(wq=False, wo=False)
    dynamic["x"] = fake(2, object(), 256)
    choice = choose.decide(dynamic, "layer", "auto")
    assert choice.fused and "dynamic shapes, not measured" in choice.reason and len(measured) == 1


def test_flop_per_byte_counts_what_the_kernel_moves():
    """QK^T and P V FLOPs over x read, y written, k, v and the mask, once each (bf16: 2 bytes an element)."""
    def intensity(B, Lq, D, H, Lk, mask=None):
        d = D // H
        return choose.flop_per_byte(dict(x=fake(B, Lq, D), k=fake(B, H, Lk, d), v=fake(B, H, Lk, d), mask=mask))

    assert intensity(32, 2048, 1024, 16, 77) == pytest.approx(2048 * 77 / (2048 + 77))    # the seed: 74
    assert intensity(32, 2048, 1024, 16, 2048) == pytest.approx(1024)
    assert intensity(64, 1, 1280, 20, 1500) < 1                                           # decode
    with_mask = intensity(2, 64, 256, 4, 77, mask=fake(2, 1, 1, 77, dtype=torch.bool))
    flops, nbytes = 4 * 2 * 64 * 77 * 256, 2 * (2 * 2 * 64 * 256 + 2 * 2 * 77 * 256) + 2 * 77
    assert with_mask == pytest.approx(flops / nbytes)


def test_the_kernel_is_judged_on_gpu_time_the_plan_also_on_host_time():
    """The kernel's host cost per call is that of the few launches the compiler's wrapper makes for the same block;
    the plan's (Python, cuBLAS) is several times more and decides in a host-bound model."""
    assert choose._verdict(Timing(40.0, 180.0, 80.0, 40.0), what="kernel").fused
    assert not choose._verdict(Timing(40.0, 180.0, 80.0, 40.0), what="plan").fused
    assert not choose._verdict(Timing(79.0, 10.0, 80.0, 40.0), what="kernel").fused  # inside the noise margin


def test_replayed_as_cuda_graphs_the_plan_is_judged_on_gpu_time_alone(monkeypatch):
    """Option cudagraphs: the plan's host cost is paid once at capture, so a plan faster on the GPU is taken even
    where its host time per call exceeds the compiler's GPU time; one measurement serves both settings."""
    calls = []
    monkeypatch.setattr(choose, "_measure", lambda *a: calls.append(a) or Timing(40.0, 180.0, 80.0, 40.0))
    monkeypatch.setattr(choose, "_key", lambda tensors, norm, scale: "one shape")
    monkeypatch.setattr(choose, "_timings", {})
    with_host = choose.decide(args(), "layer", "measure")
    graphs = choose.decide(args(), "layer", "measure", host_time_counts=False)
    assert not with_host.fused and "180.0 µs host per call" in with_host.reason
    assert graphs.fused and "host time not counted: replayed as CUDA graphs (option cudagraphs)" in graphs.reason
    assert len(calls) == 1
    assert not choose._verdict(Timing(79.0, 10.0, 80.0, 40.0), what="plan", host_time_counts=False).fused


def test_the_ridge_follows_the_arch_and_is_low_where_fusednorm_was_not_measured(measured, monkeypatch):
    """sm_90: the H200's measured 192; sm_80: 140 (an A100's rate over its bandwidth); elsewhere 64, so that a
    GPU nobody measured times the block instead of assuming the kernel wins."""
    assert (choose.ridge_flop_per_byte(90), choose.ridge_flop_per_byte(80), choose.ridge_flop_per_byte(86)) == (
        192.0, 140.0, 64.0)
    between = args(Lq=1024, Lk=200, wq=False, wo=False)  # 1024 * 200 / 1224: 167 FLOP/byte
    seed_like = args(Lq=2048, Lk=77, wq=False, wo=False)  # 74 FLOP/byte
    assert choose.decide(between, "layer", "auto").fused and measured == []
    monkeypatch.setattr(choose, "_arch", lambda x: 80)
    choose.decide(between, "layer", "auto")
    assert choose.decide(seed_like, "layer", "auto").fused and measured == [(2, 1024, 256)]
    monkeypatch.setattr(choose, "_arch", lambda x: 86)
    timed = choose.decide(seed_like, "layer", "auto")
    assert measured == [(2, 1024, 256), (2, 2048, 256)] and timed.reason.endswith("(74 FLOP/byte > 64)")


def test_host_time_leaves_out_a_one_off_stall(monkeypatch):
    """A first call's setup (or the compiler's workers taking the CPU once) is not the plan's cost per call."""
    import time

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    def op():
        calls.append(None)
        time.sleep(0.05 if len(calls) in (1, 30) else 0.0002)  # a cold first call, then one stall in a window

    host = choose._host_us(op, reps=20, windows=3)
    assert 200 <= host < 2000  # the steady ~0.2 ms per call, neither stall spread over the window
    assert len(calls) == 2 + 3 * 20


def test_the_default_times_a_block_too_small_to_fill_the_gpu(measured, monkeypatch):
    """kernel='auto': a memory-bound block with fewer (batch, head, 64-row block) units than SMs (decode at a small
    batch) is timed like a compute-bound one; the same step at a batch that fills the GPU is not."""
    monkeypatch.setattr(choose, "_sm_count", lambda x: 132)
    decode_b1 = args(B=1, Lq=1, D=1280, H=20, Lk=1500, wq=False, wo=False)
    choice = choose.decide(decode_b1, "layer", "auto")
    assert measured == [(1, 1, 1280)] and not choice.fused
    assert choice.reason.endswith("where the block leaves SMs idle (20 (batch, head, 64-row block) units for 132 SMs)")
    decode_b16 = args(B=16, Lq=1, D=1280, H=20, Lk=1500, wq=False, wo=False)
    assert choose.decide(decode_b16, "layer", "auto").fused and len(measured) == 1  # 320 units: untimed
    assert choose.work_units(args(B=2, Lq=129, H=4, wq=False, wo=False)) == 2 * 4 * 3
