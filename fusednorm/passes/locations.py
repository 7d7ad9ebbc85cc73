"""Where a node comes from in the user's code: the innermost frame of its stack trace outside torch itself.

Dynamo records no stack trace for code inside torch (nn.TransformerDecoderLayer, nn.MultiheadAttention); there the
location is the forward of the innermost module the node was traced in, with that module's path in the model.
"""
from __future__ import annotations

import inspect
import os
import re

import torch
import torch.fx

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ROOT = re.compile(r"^L\['[^']*'\]\.?")


def source_location(node: torch.fx.Node | None) -> str:
    """'file:line' of the innermost frame outside torch (else the outermost frame), or of the module's forward."""
    if node is None:
        return ""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if frames:
        outside = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
        path, line = outside[-1] if outside else frames[0]
        return f"{path}:{line}"
    return _module_location(node)


def _module_location(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    where = _ROOT.sub("", path) or "(the compiled module)"
    try:
        file = inspect.getsourcefile(cls.forward)
        line = inspect.getsourcelines(cls.forward)[1]
    except (TypeError, OSError, AttributeError):
        return f"{where} ({getattr(cls, '__name__', cls)})"
    return f"{file}:{line} ({where}: {cls.__name__}.forward)"


def locations(roles: dict[str, torch.fx.Node | None]) -> dict[str, str]:
    return {role: source_location(node) for role, node in roles.items() if node is not None}
