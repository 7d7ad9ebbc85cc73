"""Options cudagraphs and inductor on the CPU: what the backend asks of Inductor, the folded weights it holds for
the graphs, and the refusals. (The capture itself runs in tests/gpu/test_plan_gpu.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fusednorm
from fusednorm.backend import fusednorm_backend
from fusednorm.options import Options
from fusednorm.passes.rewrite import FUSED_OP
from fusednorm.plans import weights
from test_backend_health import CrossBlock, inputs


def test_the_option_is_off_by_default_and_checked():
    assert Options.from_dict({}).cudagraphs is False
    with pytest.raises(ValueError, match=r"cudagraphs='yes'; expected True or False"):
        Options.from_dict({"cudagraphs": "yes"})
    with pytest.raises(ValueError, match="cudagraphs=True and check_numerics=True do not go together"):
        Options.from_dict({"cudagraphs": True, "check_numerics": True})


@pytest.fixture
def compile_fx_calls(monkeypatch):
    calls = []

    def compile_fx(gm, example_inputs, config_patches=None, decompositions=None):
        calls.append(config_patches)
        assert FUSED_OP in decompositions and len(decompositions) > 1  # Inductor's table and the op's, for the CPU

        def compiled(args):  # what it runs does not matter here, only under which capture context
            return getattr(weights._capture, "held", None), len(args)

        compiled._boxed_call = True
        return compiled

    import torch._inductor.compile_fx as inductor

    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    return calls


def _graph(fused: bool) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    if fused:  # the node the rewrite leaves; never run here
        k = graph.placeholder("k")
        graph.output(graph.call_function(torch.ops.fusednorm.pre_norm_cross_attn.default,
                                         (x, k, k, None, None, None, None, None, None, None, "layer", 1e-5, None)))
    else:
        graph.output(graph.call_function(torch.sin, (x,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _cuda_fakes(n):
    with FakeTensorMode():
        return [torch.empty(2, 3, 4, device="cuda") for _ in range(n)]


def test_cuda_graphs_are_asked_of_inductor_only_for_cuda_inputs(compile_fx_calls):
    opts = {"cudagraphs": True, "rewrite": False}
    fusednorm_backend(_graph(False), [torch.randn(2, 3, 4)], options=opts)
    fusednorm_backend(_graph(False), _cuda_fakes(1), options=opts)
    fusednorm_backend(_graph(False), _cuda_fakes(1), options={"rewrite": False})
    assert compile_fx_calls == [None, {"triton.cudagraphs": True}, None]


def test_a_graph_with_fused_blocks_holds_their_folded_weights_and_refreshes_them_before_each_call(
        compile_fx_calls, monkeypatch):
    refreshed = []
    monkeypatch.setattr(weights.GraphWeights, "refresh", lambda self: refreshed.append(self))
    plain = fusednorm_backend(_graph(False), _cuda_fakes(1), options={"cudagraphs": True, "rewrite": False})
    assert not hasattr(plain, "held_weights")  # nothing fused: nothing to hold
    run = fusednorm_backend(_graph(True), _cuda_fakes(2), options={"cudagraphs": True, "rewrite": False})
    assert run._boxed_call is True and isinstance(run.held_weights, weights.GraphWeights)
    held, n_args = run([torch.randn(1), torch.randn(1)])  # as Dynamo calls a boxed function
    assert held is run.held_weights and refreshed == [held] and n_args == 2
    assert getattr(weights._capture, "held", None) is None  # the capture context ends with the call


def test_with_the_eager_compiler_dynamos_cudagraphs_backend_captures(monkeypatch):
    import torch._dynamo.backends.cudagraphs as dynamo_cudagraphs

    used = []
    monkeypatch.setattr(dynamo_cudagraphs, "cudagraphs", lambda gm, ex: used.append(gm) or gm.forward)
    gm = _graph(False)
    fusednorm_backend(gm, _cuda_fakes(1), options={"cudagraphs": True, "compiler": "eager", "rewrite": False})
    assert used == [gm]
    fusednorm_backend(gm, [torch.randn(1)], options={"cudagraphs": True, "compiler": "eager", "rewrite": False})
    assert len(used) == 1  # CPU inputs: nothing to capture


def test_a_cpu_model_compiled_with_the_option_runs_as_without_it():
    torch.manual_seed(0)
    model = CrossBlock()
    x, ctx = inputs()
    compiled = torch.compile(model, backend="fusednorm", options={"cudagraphs": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, ctx), model(x, ctx), rtol=1e-5, atol=1e-5)
    assert fusednorm.backend.last_report.matches, "the block was not matched"


def test_inductor_config_reaches_compile_fx_and_is_checked(compile_fx_calls):
    """What torch.compile's mode= and options= give the inductor backend, for the rest of the graph."""
    fusednorm_backend(_graph(False), _cuda_fakes(1), options={"rewrite": False, "inductor": {"max_autotune": True}})
    fusednorm_backend(_graph(False), _cuda_fakes(1), options={
        "rewrite": False, "inductor": {"max_autotune": True, "triton.cudagraphs": True}})  # = cudagraphs=True
    fusednorm_backend(_graph(False), [torch.randn(1)], options={
        "rewrite": False, "inductor": {"triton.cudagraphs": True}})  # CPU inputs: nothing to capture
    assert compile_fx_calls == [{"max_autotune": True}, {"max_autotune": True, "triton.cudagraphs": True}, None]
    assert Options.from_dict({"inductor": {"triton.cudagraphs": True}}).cudagraphs is True
    with pytest.raises(ValueError, match=r"unknown Inductor config key\(s\) \['max_autotone'\]"):
        Options.from_dict({"inductor": {"max_autotone": True}})
    with pytest.raises(ValueError, match="option inductor applies to compiler='inductor', not 'eager'"):
        Options.from_dict({"inductor": {"max_autotune": True}, "compiler": "eager"})
    with pytest.raises(ValueError, match="expected a dict"):
        Options.from_dict({"inductor": "max-autotune"})
    with pytest.raises(ValueError, match=r"unknown backend option\(s\) \['max_autotune'\].*Inductor settings go in"):
        Options.from_dict({"max_autotune": True})  # torch.compile(options=...) as for the inductor backend
    with pytest.raises(ValueError, match=r"\['mode'\].*options=\{'cudagraphs': True\}"):
        Options.from_dict({"mode": "reduce-overhead"})


def test_dynamo_calls_the_holding_wrapper_as_it_called_the_compiled_graph(monkeypatch):
    """The wrapper keeps Dynamo's calling convention (boxed) and the result: here Inductor is asked for CUDA graphs
    on a CPU model (it skips them), so the wrapper around its output runs under a real torch.compile."""
    import fusednorm.backend as backend

    monkeypatch.setattr(backend, "_has_cuda_input", lambda example_inputs: True)
    wrapped = []
    real_wrap = backend._holding_folded_weights
    monkeypatch.setattr(backend, "_holding_folded_weights", lambda c: wrapped.append(real_wrap(c)) or wrapped[-1])
    refreshed = []
    monkeypatch.setattr(weights.GraphWeights, "refresh", lambda self: refreshed.append(self))
    torch.manual_seed(0)
    model = CrossBlock()
    compiled = torch.compile(model, backend="fusednorm", options={"cudagraphs": True})
    for _ in range(2):
        x, ctx = inputs()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, ctx), model(x, ctx), rtol=1e-5, atol=1e-5)
    assert len(wrapped) == 1 and refreshed == [wrapped[0].held_weights] * 2


def test_the_rewritten_graph_keeps_dynamos_static_inputs(monkeypatch):
    """AOTAutograd takes the inputs a CUDA graph may keep in place (the parameters) from what Dynamo leaves on the
    graph module; the rewrite's copy must keep it, or every replay copies every parameter in first."""
    import torch._functorch.aot_autograd as aot

    found = []
    real = aot._try_get_metadata_from_dynamo

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        found.append(result[1])
        return result

    monkeypatch.setattr(aot, "_try_get_metadata_from_dynamo", spy)
    torch.manual_seed(0)
    model = CrossBlock()
    x, ctx = inputs()
    for backend in ("inductor", "fusednorm"):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=backend)(x, ctx)
    assert fusednorm.backend.last_report.matches, "the block was not matched"
    n_params = len(list(model.parameters()))
    assert len(found) == 2 and len(found[0]) >= n_params, found
    assert found[1] == found[0]  # the same static inputs as Inductor alone finds
