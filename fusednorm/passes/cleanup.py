"""cleanup: drop the nodes the rewrite left dead, check the graph, regenerate its code.

In-place ops are kept even when their result is unused: their effect is on their input.
"""
from __future__ import annotations

import torch.fx

from ..patterns.canonical import _is_inplace
from .context import PassContext


def run(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or _is_inplace(n))
    gm.graph.lint()
    gm.recompile()
    return gm
