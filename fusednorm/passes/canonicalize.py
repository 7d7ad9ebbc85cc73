"""canonicalise: one spelling per computation, so patterns need fewer variants (rules: patterns/canonical.py).

Method calls become functions (x.view -> torch.reshape, x @ y / bmm -> torch.matmul, x.softmax -> F.softmax ...),
casts become x.to(dtype), and identity ops are dropped: contiguous() where no user relies on its layout, dropout
with p=0 or training=False, casts to the same dtype, reshapes to the same shape, multiplying or dividing by 1.
Values are unchanged.
"""
from __future__ import annotations

import torch.fx

from ..patterns.canonical import canonicalize_graph
from .context import PassContext


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    canonicalize_graph(gm.graph, use_meta=True)
    return gm
