"""The projection plan's algebra on the CPU: folding the norm into Wq and bo into the out GEMM changes nothing."""
import pytest
import torch
import torch.nn.functional as F

from fusednorm.plans.plan import attention_stage_reference
from fusednorm.plans.weights import K_ALIGN, fold_weights
from fusednorm.reference import compute_dtype, reference_pre_norm_cross_attn

B, Lq, D, H, Lk, d = 2, 9, 64, 4, 7, 16


def _weights(dtype, gamma=True, beta=True, bq=True, bo=True):
    r = lambda *s, scale=1.0: (scale * torch.randn(*s)).to(dtype)  # noqa: E731
    return dict(gamma=(1 + r(D, scale=0.2)).to(dtype) if gamma else None, beta=r(D, scale=0.1) if beta else None,
                wq=r(H * d, D, scale=D ** -0.5), bq=r(H * d, scale=0.1) if bq else None,
                wo=r(D, H * d, scale=D ** -0.5), bo=r(D, scale=0.1) if bo else None)


def _plan_in_torch(x, k, v, mask, norm, w):
    """The three plan stages with torch ops standing in for cuBLAS and the stage kernel."""
    fw = fold_weights(norm, w["gamma"], w["beta"], w["wq"], w["bq"], w["wo"], w["bo"], x.dtype)
    ct = compute_dtype(x.dtype)
    x2 = x.reshape(B * Lq, D)
    qraw = x2.to(ct) @ fw.wq.to(ct).t()
    o = attention_stage_reference(x, k, v, mask, norm, 1e-5, None, qraw, fw.u, fw.b).reshape(B * Lq, -1)
    if fw.o_cols > H * d:  # the kernel writes [o, 1, 0...]
        pad = torch.zeros(B * Lq, fw.o_cols - H * d, dtype=o.dtype)
        pad[:, 0] = 1
        o = torch.cat([o, pad], 1)
    return (x2.to(ct) + o.to(x.dtype).to(ct) @ fw.wo.to(ct).t()).to(x.dtype).view(B, Lq, D)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("biases", [True, False])
def test_fold_is_exact_in_float64(norm, biases):
    torch.manual_seed(1)
    w = _weights(torch.float64, beta=biases and norm == "layer", bq=biases, bo=biases)
    x, k, v = torch.randn(B, Lq, D, dtype=torch.float64), *torch.randn(2, B, H, Lk, d, dtype=torch.float64)
    mask = torch.rand(B, 1, 1, Lk) > 0.3
    got = _plan_in_torch(x, k, v, mask, norm, w)
    want = reference_pre_norm_cross_attn(x, k, v, *w.values(), mask, norm, 1e-5, None)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
    if biases:
        assert fold_weights(norm, *w.values(), torch.float64).o_cols == H * d + K_ALIGN


@pytest.mark.parametrize("mean", [0.0, 30.0])
def test_fold_error_in_bf16_stays_within_twice_eager(mean):
    """Activations whose mean is large against their spread: the fold's cancellation happens in float32."""
    torch.manual_seed(2)
    dt = torch.bfloat16
    w = _weights(dt)
    x = (torch.randn(B, Lq, D) + mean).to(dt)
    k, v = torch.randn(2, B, H, Lk, d).to(dt)
    want = reference_pre_norm_cross_attn(x.double(), k.double(), v.double(),
                                         *(t.double() for t in w.values()), None, "layer", 1e-5, None)
    h = F.layer_norm(x, (D,), w["gamma"], w["beta"], 1e-5)
    q = F.linear(h, w["wq"], w["bq"]).view(B, Lq, H, d).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, Lq, H * d)
    eager = x + F.linear(a, w["wo"], w["bo"])
    got = _plan_in_torch(x, k, v, None, "layer", w)
    err = lambda y: ((y.double() - want).norm() / (want - x.double()).norm()).item()  # noqa: E731
    assert err(got) <= 2 * err(eager), (err(got), err(eager))


def test_folded_weights_follow_in_place_updates_in_the_same_buffers():
    """A captured CUDA graph reads the folded buffers by address: an update re-folds into them, it does not move."""
    torch.manual_seed(3)
    w = _weights(torch.float32)
    first = fold_weights("layer", *w.values(), torch.float32)
    buffers = [t.data_ptr() for t in first.tensors()]
    before = first.wq.clone()
    assert fold_weights("layer", *w.values(), torch.float32) is first  # cached
    with torch.no_grad():
        w["gamma"].mul_(2.0)   # an optimizer step or load_state_dict bumps the version counter
        w["bo"].add_(1.0)
    second = fold_weights("layer", *w.values(), torch.float32)
    assert second is first and [t.data_ptr() for t in second.tensors()] == buffers
    assert torch.allclose(second.wq, 2 * before)
    Dq = w["wo"].shape[1]
    assert torch.equal(second.wo[:, Dq], w["bo"])


def test_folded_buffers_are_copies_unless_the_fold_is_the_weight_itself():
    """Kept buffers never share memory with a temporary of the fold; Wo without bo is used as it is."""
    torch.manual_seed(6)
    w = _weights(torch.float32, bo=False)
    folded = fold_weights("layer", *w.values(), torch.float32)
    assert folded.wo is w["wo"]
    assert folded.wq.data_ptr() != w["wq"].data_ptr() and torch.equal(folded.wq, w["wq"] * w["gamma"])


def test_inference_tensors_are_folded_every_call():
    """Inference tensors carry no version counter, so a cached fold could go stale unseen: nothing is cached."""
    with torch.inference_mode():
        w = _weights(torch.float32)
        first = fold_weights("layer", *w.values(), torch.float32)
        w["gamma"].mul_(2.0)
        second = fold_weights("layer", *w.values(), torch.float32)
    assert second is not first and torch.allclose(second.wq, 2 * first.wq)


def test_new_views_of_the_same_weights_hit_the_cache():
    """A compiled graph may pass a fresh view object of a parameter on every call: same storage, same version."""
    torch.manual_seed(4)
    w = _weights(torch.float32)
    first = fold_weights("layer", *w.values(), torch.float32)
    views = {n: t.detach() for n, t in w.items()}  # new objects over the same storages and version counters
    assert fold_weights("layer", *views.values(), torch.float32) is first


def test_freed_weights_memory_reused_by_new_weights_is_folded_again():
    """The old key (pointer + version) would hit here when the allocator hands back the same address."""
    torch.manual_seed(5)
    for _ in range(5):
        w = _weights(torch.float32)
        got = fold_weights("layer", *w.values(), torch.float32)
        assert torch.equal(got.wq, w["wq"] * w["gamma"]), "stale folded weights"
        del w, got  # the next round's weights may land in the same memory


def test_entries_of_freed_weights_are_dropped_when_the_next_is_made():
    """Weights computed inside a graph are new tensors on every call: their entries must not pile up."""
    from fusednorm.plans import weights

    torch.manual_seed(7)
    for _ in range(3):
        fold_weights("layer", *_weights(torch.float32).values(), torch.float32)  # freed right after
    live = _weights(torch.float32)
    fold_weights("layer", *live.values(), torch.float32)
    assert not any(entry.expired() for entry in weights._cache.values())


def test_threads_sharing_the_cache_each_get_their_own_weights_folded():
    """Threads serving models at once: entries made, dropped and refolded concurrently (switching threads as often
    as the interpreter allows) never break a lookup and never hand a thread another's fold."""
    import sys
    import threading

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors = []

    def serve(seed):
        torch.manual_seed(seed)
        try:
            for i in range(150):
                w = _weights(torch.float32)
                if i % 3 == 0:
                    fold_weights("layer", *w.values(), torch.float32)
                    with torch.no_grad():
                        w["wq"].mul_(2)  # an update in place: the next call refolds the entry
                got = fold_weights("layer", *w.values(), torch.float32)
                if not torch.equal(got.wq, w["wq"] * w["gamma"]):
                    errors.append(f"thread {seed}, call {i}: another fold")
        except Exception as e:  # noqa: BLE001 - reported below with the others
            errors.append(f"thread {seed}: {type(e).__name__}: {e}")

    try:
        threads = [threading.Thread(target=serve, args=(seed,)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    assert errors == []


def test_plan_without_wq_folds_only_the_out_projection():
    torch.manual_seed(5)
    w = _weights(torch.float32)
    folded = fold_weights("layer", w["gamma"], w["beta"], None, None, w["wo"], w["bo"], torch.float32)
    assert folded.wq is None and folded.u is None and folded.b is None
    Dq = w["wo"].shape[1]
    assert folded.o_cols == Dq + 8 and torch.equal(folded.wo[:, Dq], w["bo"]) and not folded.wo[:, Dq + 1:].any()
