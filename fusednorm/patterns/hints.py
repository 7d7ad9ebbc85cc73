"""Checking a candidate match without touching Dynamo's shape environment.

Candidates are checked on static stand-ins: every fake tensor becomes a fake tensor of the sizes this compile saw
(its size hints), in a private FakeTensorMode without a shape env. Running a pattern or a binding there can never
add a guard or specialise a symbol; the graph's own ops have already tied its symbolic sizes together with guards,
so a check that passes on the hints passes for every size those guards admit.
"""
from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .ops import hint


class HintSpace:
    def __init__(self):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._cache: dict[int, torch.Tensor] = {}

    def of(self, value):
        """The static stand-in for a graph value (a node, a fake tensor, a SymInt, a tuple of those ...)."""
        if isinstance(value, torch.fx.Node):
            if "example_value" not in value.meta:
                raise LookupError(f"node {value.name} has no example value")
            return self.of(value.meta["example_value"])
        if isinstance(value, torch.Tensor):
            key = id(value)
            if key not in self._cache:
                shape = [hint(s) for s in value.shape]
                stride = [hint(s) for s in value.stride()]
                with self.mode:
                    self._cache[key] = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
            return self._cache[key]
        if isinstance(value, (list, tuple)):
            return type(value)(self.of(v) for v in value)
        return hint(value)
