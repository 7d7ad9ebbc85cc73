"""One spelling per computation: the rewrite rules shared by the canonicalise pass and by pattern tracing.

Every rule preserves values exactly. Rules that need shapes or dtypes (dropping a cast to the same dtype, a reshape
to the same shape, a multiply by 1) only run on graphs with metadata, that is on Dynamo's graphs, not on patterns.
An identity op is only dropped when nothing in the graph mutates the tensors it connects (a dropped
``contiguous()`` must not let an in-place op reach a tensor it did not reach before), and a ``contiguous()`` stays
unless every user is known to read values whatever the strides (it stays before a graph output, a ``.view()``, a
convolution, a custom op).
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .ops import LAYER_NORM, LINEAR, RMS_NORM, SDPA, SOFTMAX, example_value, normalize_dims, rank_of

_MATMULS = {torch.matmul, torch.bmm, operator.matmul}
_MATMUL_METHODS = {"matmul", "bmm", "__matmul__"}
_ARITH_FUNCTIONS = {torch.add: operator.add, torch.mul: operator.mul, torch.div: operator.truediv,
                    torch.sub: operator.sub, torch.true_divide: operator.truediv}
_ARITH_METHODS = {"add": operator.add, "mul": operator.mul, "div": operator.truediv, "sub": operator.sub,
                  "true_divide": operator.truediv}
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_RESHAPE_METHODS = {"view", "reshape"}
_TRANSPOSE_METHODS = {"transpose", "swapaxes", "swapdims"}
_TRANSPOSE_FUNCTIONS = {torch.transpose, torch.swapaxes, torch.swapdims}
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "contiguous", "to",
                 "flatten", "unflatten", "narrow", "select", "split", "chunk", "t", "detach", "as_strided",
                 "view_as", "expand_as", "swapaxes", "swapdims", "float", "half", "bfloat16", "type_as", "unbind"}
_VIEW_FUNCTIONS = {torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, operator.getitem,
                   torch.flatten, torch.unflatten, torch.narrow, torch.select, torch.split, torch.chunk, torch.t,
                   torch.detach, torch.swapaxes, torch.swapdims, torch.unbind}


def canonicalize_graph(graph: torch.fx.Graph, use_meta: bool) -> int:
    """Rewrite every node into its canonical spelling; returns the number of nodes changed or dropped."""
    mutated = _mutated_aliases(graph) if use_meta else set()
    changed = 0
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        rule = _canonical_form(node, use_meta)
        if rule is None:
            continue
        if rule[0] == "drop":
            source = rule[1]
            if node in mutated or source in mutated or _layout_matters(node, use_meta):
                continue
            node.replace_all_uses_with(source)
            graph.erase_node(node)
        elif rule[0] == "softmax_cast":
            _split_softmax_dtype(graph, node, *rule[1:], use_meta=use_meta)
        else:
            _, op, target, args, kwargs = rule
            if (op, target, tuple(args), dict(kwargs)) == (node.op, node.target, tuple(node.args), dict(node.kwargs)):
                continue
            with graph.inserting_before(node):
                new = graph.create_node(op, target, tuple(args), dict(kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        changed += 1
    return changed


def _canonical_form(node: torch.fx.Node, use_meta: bool):
    """("drop", source) | ("replace", op, target, args, kwargs) | None."""
    op, target, args, kwargs = node.op, node.target, node.args, node.kwargs
    if op == "call_method":
        name = target
        if name == "contiguous" and not kwargs and len(args) == 1:
            return ("drop", args[0])
        if name in _RESHAPE_METHODS and len(args) >= 2 and not kwargs:
            if len(args) == 2 and isinstance(args[1], torch.dtype):
                return None  # x.view(dtype) reinterprets bits: not a reshape
            shape = _shape_argument(args[1:])
            return None if shape is None else _reshape(node, args[0], shape, use_meta)
        if name in _TRANSPOSE_METHODS and len(args) == 3 and not kwargs:
            return _transpose(node, args[0], args[1], args[2], use_meta)
        if name == "permute" and len(args) >= 2 and not kwargs:
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            return _permute(node, args[0], tuple(dims), use_meta)
        if name in _MATMUL_METHODS and len(args) == 2 and not kwargs:
            return ("replace", "call_function", torch.matmul, args, {})
        if name in ("rsqrt",) and len(args) == 1 and not kwargs:
            return ("replace", "call_function", torch.rsqrt, args, {})
        if name == "pow" and len(args) == 2 and not kwargs:
            return ("replace", "call_function", torch.pow, args, {})
        if name == "square" and len(args) == 1 and not kwargs:
            return ("replace", "call_function", torch.pow, (args[0], 2), {})
        if name == "mean":
            return _mean(args, kwargs)
        if name == "softmax":
            return _softmax(args, kwargs)
        if name in _ARITH_METHODS and len(args) == 2 and not kwargs:
            return _arith(node, _ARITH_METHODS[name], args, use_meta)
        if name in _CAST_METHODS and len(args) == 1 and not kwargs:
            return _cast(node, args[0], _CAST_METHODS[name], use_meta)
        if name == "type_as" and len(args) == 2 and not kwargs:
            other = example_value(args[1])
            return _cast(node, args[0], other.dtype, use_meta) if isinstance(other, torch.Tensor) else None
        if name == "to":
            return _to(node, args, kwargs, use_meta)
        return None
    # call_function
    if target in _MATMULS and len(args) == 2 and not kwargs:
        return ("replace", "call_function", torch.matmul, args, {})
    if target is torch.reshape and len(args) == 2 and not kwargs:
        shape = _shape_argument(args[1:])
        return None if shape is None else _reshape(node, args[0], shape, use_meta)
    if target in _TRANSPOSE_FUNCTIONS and len(args) == 3 and not kwargs:
        return _transpose(node, args[0], args[1], args[2], use_meta)
    if target is torch.permute and len(args) == 2 and not kwargs:
        return _permute(node, args[0], tuple(args[1]), use_meta)
    if target is operator.pow and len(args) == 2:
        return ("replace", "call_function", torch.pow, args, {})
    if target is torch.square and len(args) == 1 and not kwargs:
        return ("replace", "call_function", torch.pow, (args[0], 2), {})
    if target is torch.mean:
        return _mean(args, kwargs)
    if target in (torch.softmax, SOFTMAX, torch.Tensor.softmax):
        return _softmax(args, kwargs)
    if target in _ARITH_FUNCTIONS and len(args) == 2 and not kwargs:
        return _arith(node, _ARITH_FUNCTIONS[target], args, use_meta)
    if target in (operator.mul, operator.truediv) and len(args) == 2:
        return _arith(node, target, args, use_meta)
    if target in _DROPOUTS or target is torch.dropout:
        return _dropout(node, target, args, kwargs)
    if target is torch.rms_norm:  # Dynamo records F.rms_norm as the builtin; same arguments
        return ("replace", "call_function", RMS_NORM, args, kwargs)
    if target is torch.layer_norm and len(args) + len(kwargs) <= 5 and "cudnn_enable" not in kwargs:
        return ("replace", "call_function", LAYER_NORM, args, kwargs)
    return None


def _shape_argument(sizes):
    """x.view(a, b) and x.view((a, b)) -> (a, b); x.view(y.shape) -> the shape node itself; None if unsure."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        return tuple(sizes[0])
    if len(sizes) == 1 and isinstance(sizes[0], torch.fx.Node):
        size = sizes[0]
        value = example_value(size)
        if isinstance(value, (int, torch.SymInt)):
            return (size,)
        if isinstance(value, (tuple, list)) or (size.target is getattr and size.args[1] == "shape"):
            return size
        return None
    return tuple(sizes)


def _reshape(node, source, shape, use_meta):
    if use_meta and _same_shape(example_value(source), example_value(node)):
        return ("drop", source)
    return ("replace", "call_function", torch.reshape, (source, shape), {})


def _transpose(node, source, d0, d1, use_meta):
    rank = rank_of(source) if use_meta else None
    if rank is not None:
        d0, d1 = normalize_dims(d0, rank), normalize_dims(d1, rank)
    if isinstance(d0, int) and isinstance(d1, int):
        if d0 == d1:
            return ("drop", source)
        if (d0 >= 0) == (d1 >= 0):
            d0, d1 = min(d0, d1), max(d0, d1)
    return ("replace", "call_function", torch.transpose, (source, d0, d1), {})


def _permute(node, source, dims, use_meta):
    if not all(isinstance(d, int) for d in dims):
        return None
    dims = normalize_dims(dims, len(dims))  # a permutation names every dim, so its length is the rank
    moved = [i for i, d in enumerate(dims) if d != i]
    if not moved:
        return ("drop", source)
    if len(moved) == 2:
        return ("replace", "call_function", torch.transpose, (source, moved[0], moved[1]), {})
    return ("replace", "call_function", torch.permute, (source, tuple(dims)), {})


def _mean(args, kwargs):
    names = ("input", "dim", "keepdim")
    bound = dict(zip(names, args))
    if len(args) > 3 or any(k in bound for k in kwargs) or not set(kwargs) <= {"dim", "keepdim", "dtype"}:
        return None
    bound.update(kwargs)
    dim = bound.get("dim")
    if dim is None:
        return None
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]  # mean over [-1] is mean over -1
    extra = {"dtype": bound["dtype"]} if bound.get("dtype") is not None else {}
    return ("replace", "call_function", torch.mean, (bound["input"], dim, bool(bound.get("keepdim", False))), extra)


def _softmax(args, kwargs):
    kwargs = dict(kwargs)
    kwargs.pop("_stacklevel", None)
    if len(args) == 3 and not isinstance(args[2], int):
        args = args[:2]  # F.softmax's third positional is _stacklevel
    names = ("input", "dim", "dtype")
    if len(args) > 3:
        return None
    bound = dict(zip(names, args))
    if any(k in bound for k in kwargs) or not set(kwargs) <= set(names):
        return None
    bound.update(kwargs)
    if bound.get("dim") is None:
        return None
    if bound.get("dtype") is not None:
        return ("softmax_cast", bound["input"], bound["dim"], bound["dtype"])
    return ("replace", "call_function", SOFTMAX, (bound["input"],), {"dim": bound["dim"]})


def _split_softmax_dtype(graph, node, source, dim, dtype, use_meta):
    """softmax(x, dim, dtype=t) casts x to t first (as documented): spell it softmax(x.to(t), dim)."""
    src = example_value(source)
    with graph.inserting_before(node):
        if use_meta and isinstance(src, torch.Tensor) and src.dtype == dtype:
            cast = source
        else:
            cast = graph.create_node("call_method", "to", (source, dtype), {})
            cast.meta = {k: v for k, v in node.meta.items() if k != "example_value"}
            if isinstance(src, torch.Tensor):
                cast.meta["example_value"] = src.to(dtype)
        new = graph.create_node("call_function", SOFTMAX, (cast,), {"dim": dim})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _is_one(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


def _arith(node, fn, args, use_meta):
    a, b = args
    if use_meta and fn in (operator.mul, operator.truediv):
        # x * 1, 1 * x and x / 1 are the identity when they change neither dtype nor shape
        for source, one in ((a, b), (b, a)) if fn is operator.mul else ((a, b),):
            if _is_one(one) and isinstance(source, torch.fx.Node):
                src, out = example_value(source), example_value(node)
                if isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype \
                        and _same_shape(src, out):
                    return ("drop", source)
    return ("replace", "call_function", fn, args, {})


def _cast(node, source, dtype, use_meta):
    src = example_value(source)
    if use_meta and isinstance(src, torch.Tensor) and src.dtype == dtype:
        return ("drop", source)
    return ("replace", "call_method", "to", (source, dtype), {})


def _to(node, args, kwargs, use_meta):
    """x.to(dtype) / x.to(device, dtype) / x.to(other) / x.to(dtype=..., device=...) with no copy or layout change."""
    source, rest = args[0], args[1:]
    if set(kwargs) - {"dtype", "device", "non_blocking"}:
        return None
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for value in rest:
        if isinstance(value, torch.dtype):
            dtype = value
        elif isinstance(value, (torch.device, str)):
            device = torch.device(value)
        elif isinstance(value, torch.fx.Node) and isinstance(example_value(value), torch.Tensor):
            other = example_value(value)
            dtype, device = other.dtype, other.device
        elif isinstance(value, bool):
            continue  # non_blocking: no effect when the device does not change
        else:
            return None
    src = example_value(source)
    if device is not None:
        if not (use_meta and isinstance(src, torch.Tensor) and torch.device(device) == src.device):
            return None  # a device move is not a cast
    if dtype is None:
        return ("drop", source) if device is not None else None
    if isinstance(dtype, torch.fx.Node) and not use_meta:
        return ("replace", "call_method", "to", (source, dtype), {})
    if not isinstance(dtype, torch.dtype):
        return None
    return _cast(node, source, dtype, use_meta)


def _dropout(node, target, args, kwargs):
    """Dropout is the identity when p == 0 or when not training (both literal)."""
    if target is torch.dropout:
        names, defaults = ("input", "p", "train"), {}
    else:
        names, defaults = ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    training = bound.get("train", bound.get("training"))
    p = bound.get("p")
    inert = training is False or (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)
    return ("drop", bound["input"]) if inert and isinstance(bound.get("input"), torch.fx.Node) else None


def _same_shape(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
                      operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul, operator.setitem}


def _is_inplace(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return node.target in _INPLACE_OPERATORS  # operator.and_ / or_ are a & b, a | b: trailing _, no mutation
        if node.kwargs.get("inplace") is True:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("__")
    return False


def _is_view_like(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and (node.target in _VIEW_FUNCTIONS or node.target in _DROPOUTS
                                           or node.target is torch.dropout)


# Users that read a tensor's values whatever its strides: a contiguous() feeding only these can go. Anything else
# (a convolution, whose lowering and speed depend on the layout; a custom op that requires contiguous input; a
# .view() that stays one) keeps it, as does a graph output (the caller may .view() it).
_VALUE_METHODS = {"reshape", "transpose", "permute", "contiguous", "to", "float", "half", "bfloat16", "double",
                  "type_as", "matmul", "bmm", "mul", "add", "sub", "div", "true_divide", "softmax", "mean", "pow",
                  "square", "rsqrt", "size", "dim"}
_VALUE_FUNCTIONS = {torch.reshape, torch.transpose, torch.permute, torch.swapaxes, torch.swapdims, torch.matmul,
                    torch.bmm, torch.baddbmm, operator.matmul, LINEAR, SDPA, SOFTMAX, torch.softmax, LAYER_NORM,
                    RMS_NORM, torch.layer_norm, torch.rms_norm, torch.mean, torch.pow, torch.rsqrt, torch.square,
                    operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul,
                    torch.div, torch.dropout, *_DROPOUTS}


def _layout_matters(node: torch.fx.Node, use_meta: bool) -> bool:
    """Whether a contiguous() must stay: some user relies on its strides, not only on its values (see above)."""
    if node.op != "call_method" or node.target != "contiguous":
        return False
    return not all(_reads_values_only(u, use_meta) for u in node.users)


def _reads_values_only(user: torch.fx.Node, use_meta: bool) -> bool:
    if user.op == "call_method":
        if user.target in ("view", "view_as"):
            return _canonical_form(user, use_meta) is not None  # it becomes a reshape
        return user.target in _VALUE_METHODS
    return user.op == "call_function" and user.target in _VALUE_FUNCTIONS


def _mutated_aliases(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes that may share storage with a tensor some node mutates in place (views either way)."""
    seeds = [n.args[0] for n in graph.nodes if _is_inplace(n) and n.args and isinstance(n.args[0], torch.fx.Node)]
    seen: set[torch.fx.Node] = set()
    stack = list(seeds)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_view_like(n):
            stack.extend(a for a in n.all_input_nodes)
        stack.extend(u for u in n.users if _is_view_like(u) or _is_inplace(u))
    return seen
