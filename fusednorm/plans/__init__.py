"""The projection plan: norm -> Wq -> attention -> Wo + residual on CUDA in at most three launches.

Built so far, and tested on the CPU: the weight-side folding (weights.py: the norm folded into Wq, bo folded into
the out GEMM as one extra K column, cached per weight version) and the algebra of the three stages
(plan.py, with a float32 reference of the attention stage). Not built yet: the attention-stage kernel (the
generated kernel in a "folded q, write o" mode). Until it is, no block takes the plan: ``why_no_plan`` says so and
the backend leaves every block with projections to the compiler, so nothing runs slower than without fusednorm.
"""
from __future__ import annotations

NOT_BUILT = "no projection plan is built into this version (its attention-stage kernel is not generated yet)"


def why_no_plan(x, k, v, gamma, beta, wq, bq, wo, bo, mask, norm) -> str | None:
    return NOT_BUILT
