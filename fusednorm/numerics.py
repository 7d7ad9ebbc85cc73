"""The opt-in numerics check: an error that names the op when its output holds NaN or Inf."""
from __future__ import annotations

import torch


class FusedNormNumericsError(FloatingPointError):
    """Raised (only with check_numerics=True) when fusednorm.pre_norm_cross_attn produced NaN or Inf."""


def numerics_error(where: str) -> FusedNormNumericsError:
    return FusedNormNumericsError(
        f"fusednorm.pre_norm_cross_attn: non-finite values (NaN/Inf) in the output ({where}); "
        "check the inputs, the mask and the eps/scale arguments"
    )


def skipped_while_capturing(t: torch.Tensor) -> bool:
    """True (with a one-time warning) when a CUDA graph is being captured: the check's host read cannot be."""
    from .graph_memory import capturing

    if not capturing(t):
        return False
    from .warn import warn_once

    warn_once("fusednorm: check_numerics cannot read its flag while a CUDA graph is being captured; "
              "the check is skipped for captured calls")
    return True


def raise_if_not_finite(y: torch.Tensor) -> None:
    if skipped_while_capturing(y):
        return
    if not bool(torch.isfinite(y).all()):
        raise numerics_error("reference path")
