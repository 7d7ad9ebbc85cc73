"""fusednorm: a torch.compile backend that fuses pre-norm cross-attention blocks into one generated CUDA kernel."""
from __future__ import annotations

from . import op as _op  # registers torch.ops.fusednorm.*
from .op import FusedNormInputError, fused_pre_norm_cross_attn
from .numerics import FusedNormNumericsError
from .warn import FusedNormWarning
from .backend import register as _register_backend
from .explain import ExplainError, explain
from .patterns.registry import register_pattern, unregister_pattern
from .plans.weights import GraphWeights

_register_backend()

__all__ = [
    "fused_pre_norm_cross_attn",
    "FusedNormInputError",
    "FusedNormNumericsError",
    "FusedNormWarning",
    "explain",
    "ExplainError",
    "register_pattern",
    "unregister_pattern",
    "GraphWeights",
]
__version__ = "0.1.0"
