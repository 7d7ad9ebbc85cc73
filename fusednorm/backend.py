"""The registered backend: rewrite pre-norm cross-attention blocks, then hand the graph to Inductor (or eager).

A failing pass never fails the user's model: the unfused graph is compiled instead, with one warning.
"""
from __future__ import annotations

import itertools

import torch
import torch.fx

from .options import Options
from .report import Report
from .warn import warn_once

_graph_ids = itertools.count(1)
last_report = Report()   # what the most recent compile did (fusednorm.explain makes its own)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own graph (nodes' meta copied shallowly) over the same parameters and submodules,
    keeping what Dynamo tells AOTAutograd beside the graph (its meta, the parameters' and placeholders' sources):
    without it AOTAutograd finds no static inputs, and CUDA graphs copy every parameter in before each replay."""
    graph = torch.fx.Graph()
    old_to_new: dict = {}
    out = graph.graph_copy(gm.graph, old_to_new, return_output_node=True)
    graph.output(out[0] if isinstance(out, tuple) else out)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for old, new in old_to_new.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


def rewrite(gm: torch.fx.GraphModule, example_inputs, opts: Options, report: Report) -> torch.fx.GraphModule:
    """Run the pass pipeline on a copy of gm; on any error return gm untouched and say why once."""
    from .passes import PassContext, run_pipeline

    graph_id = next(_graph_ids)
    ctx = PassContext(options=opts, example_inputs=example_inputs, report=Report(), graph_id=graph_id)
    try:
        new_gm = run_pipeline(_copy(gm), ctx)
    except Exception as e:  # a pass bug must not break the user's model
        msg = f"fusednorm: a rewrite pass failed ({type(e).__name__}: {e}); this graph runs unfused"
        warn_once(msg)
        report.notes.append(msg)
        return gm
    report.add_graph(ctx.report, graph_id, _dynamo_trace())
    return new_gm


def _dynamo_trace() -> tuple | None:
    """(compile id, attempt) of the frame Dynamo is compiling, or None outside Dynamo."""
    try:
        trace = torch._guards.CompileContext.current_trace_id()
    except AttributeError:  # a torch without it: restarted compiles stay in the report twice
        return None
    return None if trace is None else (str(trace.compile_id), trace.attempt)


def fusednorm_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """torch.compile(model, backend="fusednorm", options={"compiler": "inductor"|"eager", "rewrite": bool, ...}).

    With ``options={"cudagraphs": True}`` the compiled graph is replayed as CUDA graphs: Inductor's cudagraph trees
    (as mode="reduce-overhead" would), or Dynamo's cudagraphs backend with compiler="eager"."""
    global last_report
    if kwargs:
        raise TypeError(f"fusednorm: unexpected backend arguments {sorted(kwargs)}; pass options={{...}}")
    opts = Options.from_dict(options)
    report = opts.report if opts.report is not None else Report()
    if opts.report is None:
        last_report = report
    if opts.rewrite:
        gm = rewrite(gm, example_inputs, opts, report)
    graphs = opts.cudagraphs and _has_cuda_input(example_inputs)
    if opts.compiler == "eager" and not graphs:
        return gm.forward
    if opts.compiler == "eager":
        from torch._dynamo.backends.cudagraphs import cudagraphs

        compiled = cudagraphs(gm, example_inputs)   # Dynamo's "cudagraphs" backend: the graph run eagerly, captured
    else:
        from torch._inductor.compile_fx import compile_fx

        patches = {k: v for k, v in (opts.inductor or {}).items() if k != "triton.cudagraphs"}  # that one: `graphs`
        if graphs:
            patches["triton.cudagraphs"] = True
        compiled = compile_fx(gm, example_inputs, config_patches=patches or None, decompositions=_decompositions())
    return _holding_folded_weights(compiled) if graphs and _has_fused_node(gm) else compiled


def _decompositions() -> dict:
    """Inductor's own table, plus the fused op's math where it has no kernel (CPU): Inductor then compiles the
    matched block's reference inline, as fast as its code for the unfused block; on CUDA the op stays."""
    from torch._inductor.decomposition import select_decomp_table

    from .op import inline_on_cpu
    from .passes.rewrite import FUSED_OP

    return {**select_decomp_table(), FUSED_OP: inline_on_cpu}


def _has_cuda_input(example_inputs) -> bool:
    """CUDA graphs only where there is a CUDA tensor to capture (on the CPU torch would only warn it skipped them)."""
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def _has_fused_node(gm: torch.fx.GraphModule) -> bool:
    from .passes.rewrite import FUSED_OP

    return any(n.target is FUSED_OP for n in gm.graph.nodes)


def _holding_folded_weights(compiled):
    """``compiled`` (whose CUDA graphs capture fused blocks) with the plan's folded weights held for its graphs and
    folded again, in place, before every call whose weights changed since (an optimizer step, load_state_dict):
    a replay does not run the op's Python, so it could not see the change itself (plans/weights.py)."""
    from .plans.weights import GraphWeights

    held = GraphWeights()

    def run(*args):
        held.refresh()
        with held.capture():
            return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo hands a boxed function its inputs as a list
    run.held_weights = held
    return run


def register() -> None:
    """Make backend="fusednorm" resolve (the packaging entry point does this without an import, too)."""
    from torch._dynamo.backends import registry

    # Skip when already registered, or when this import is Dynamo loading our entry point (it registers next).
    if "fusednorm" in registry._COMPILER_FNS or registry._BACKENDS.get("fusednorm") is not None:
        return
    registry.register_backend(fusednorm_backend, name="fusednorm")
