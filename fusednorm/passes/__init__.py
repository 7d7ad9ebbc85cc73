"""The rewrite pipeline, one pass per file, run in this order on a copy of Dynamo's FX graph."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx

from . import canonicalize, cleanup, diagnose, match, rewrite
from .context import PassContext


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]
    why: str


PIPELINE: list[Pass] = [
    Pass("canonicalize", canonicalize.run,
         "first: one spelling per computation, so every later pass and pattern sees fewer variants"),
    Pass("match", match.run,
         "on the canonical graph: find, check and choose non-overlapping matches before anything changes"),
    Pass("diagnose", diagnose.run,
         "after match, before rewrite: explain every chain not chosen while it is still in the graph"),
    Pass("rewrite", rewrite.run,
         "replace each chosen match with one fused call; needs match's choices and the unmodified chains"),
    Pass("cleanup", cleanup.run,
         "last: the rewrite leaves the replaced nodes dead; remove them, lint, regenerate the code"),
]


def run_pipeline(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Run PIPELINE in order; ctx.after_pass(i, name, gm) sees the input graph (i = 0) and each pass's output."""
    ctx.after_pass(0, "input", gm)
    for i, p in enumerate(PIPELINE, start=1):
        gm = p.run(gm, ctx)
        ctx.after_pass(i, p.name, gm)
    return gm


__all__ = ["PIPELINE", "Pass", "PassContext", "run_pipeline"]
