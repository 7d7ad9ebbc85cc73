"""Patterns: plain eager search functions for pre-norm cross-attention blocks and how they bind to the fused op.

Built-in families (one file each): norms.py (LayerNorm, RMSNorm, hand-written RMS), projections.py (Q / out
projections), sdpa.py (F.scaled_dot_product_attention), explicit_softmax.py (matmul/bmm -> scale -> mask ->
softmax -> matmul), multihead.py (nn.MultiheadAttention); builtin.py generates their cross product.
User patterns go through the same ``register_pattern`` (registry.py).
"""
from .binding import BindingError, Derived, Fixed, PatternError
from .registry import MatchView, Pattern, register_pattern, unregister_pattern, user_patterns
from .tracing import meta_of

__all__ = ["register_pattern", "unregister_pattern", "user_patterns", "Pattern", "MatchView", "Fixed", "Derived",
           "PatternError", "BindingError", "meta_of"]
