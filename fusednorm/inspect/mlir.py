"""The rewritten graph as MLIR (torch dialect), made with torch-mlir's FX importer.

The fused op appears as ``torch.operator "torch.fusednorm.pre_norm_cross_attn"``: torch-mlir keeps ops it does not
know as generic operators, so the file shows exactly what fusednorm put in the graph.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.fx


class MlirUnavailable(RuntimeError):
    """torch-mlir is not importable here (it is an optional, CPU-side inspection tool)."""


def mlir_available() -> str | None:
    """None when torch-mlir's FX importer can be used, else why not."""
    try:
        from torch_mlir import fx  # noqa: F401
    except Exception as e:   # ImportError, or a binary built for another torch
        return f"torch-mlir is not importable ({type(e).__name__}: {e}); install it with `pip install torch-mlir`"
    return None


def graph_to_mlir(gm: torch.fx.GraphModule, example_inputs=None, func_name: str = "main") -> str:
    """MLIR text of gm, traced with fake copies of its inputs (no real memory is touched or allocated)."""
    reason = mlir_available()
    if reason:
        raise MlirUnavailable(reason)
    from torch_mlir import fx

    gm, notes = scalar_items_as_traced(gm)
    args = fake_inputs(gm, example_inputs)
    # outside the compile that is running: torch.export would otherwise take on Dynamo's guards for its inputs
    with torch._guards.tracing(None), torch._guards.compile_context(None), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # the importer's own deprecation notices
        # no decomposition table: layer_norm, linear and attention stay as the ops the graph holds
        module = fx.export_and_import(gm, *args, output_type="raw", func_name=func_name, decomposition_table={})
    return "".join(f"// {note}\n" for note in notes) + str(module)


def scalar_items_as_traced(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """A copy of gm in which ``.item()`` of a one-element graph input is the number it was traced with, and notes.

    With dynamic shapes Dynamo makes a module's float (LayerNorm's eps) a 0-d tensor input read by ``.item()``;
    torch.export turns that read into a value it knows nothing about, which the fused op's ``float eps`` refuses.
    The dump shows the traced number instead, and says so.
    """
    graph = copy.deepcopy(gm.graph)
    notes = []
    for node in list(graph.nodes):
        if not (node.op == "call_method" and node.target == "item" and node.args[0].op == "placeholder"):
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            value = _concrete(value)
        if not isinstance(value, (int, float, bool)):
            continue
        notes.append(f"{node.args[0].name} is a graph input read by .item(): shown as the value it was traced with, "
                     f"{value!r}")
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    return (torch.fx.GraphModule(gm, graph), notes) if notes else (gm, notes)


def fake_inputs(gm: torch.fx.GraphModule, example_inputs=None) -> list:
    """Fresh fake tensors (concrete shapes: symbolic sizes take their example value) for gm's placeholders."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is not None and len(example_inputs) == len(placeholders):
        values = list(example_inputs)
    else:
        values = [n.meta.get("val", n.meta.get("example_value")) for n in placeholders]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    out = []
    for node, value in zip(placeholders, values):
        if isinstance(value, torch.Tensor):
            shape = [_concrete(s) for s in value.shape]
            stride = [_concrete(s) for s in value.stride()]
            with mode:
                out.append(torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device))
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            out.append(_concrete(value))
        elif value is None:
            raise ValueError(f"placeholder {node.name!r} has no example value to trace with")
        else:
            out.append(value)
    return out


def _concrete(value):
    """A size as a plain number: a symbolic size gives the value it had when the graph was traced."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = value.node
        hint = node.hint if getattr(node, "hint", None) is not None else node.shape_env.size_hint(node.expr)
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)](hint)
    return value
