"""Backend options: torch.compile(model, backend="fusednorm", options={...})."""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields
from typing import Any

COMPILERS = ("inductor", "eager")
GRAD_POLICIES = ("compiler", "fuse")


@dataclass
class Options:
    compiler: str = "inductor"    # what compiles the rest of the graph: "inductor" or "eager"
    rewrite: bool = True          # False: fusednorm rewrites nothing (the graph goes to the compiler as it is)
    dump_dir: str | None = None   # write numbered dumps of every compiled graph here (env FUSEDNORM_DUMP too)
    sm_count: int | None = None   # bound the fused kernels' persistent grid to this many SMs
    check_numerics: bool = False  # fused kernels flag NaN/Inf in their output and the op raises
    plan: str | None = None       # blocks with projections on CUDA: "never" (left to the compiler), "measure" (the
                                  # plan where it measured faster than the compiler), "always" (plans/choose.py);
                                  # unset: "measure" with cudagraphs=True (GPU time alone decides, and the plan's
                                  # host cost is paid once), else "never" (that cost would exceed what it saves)
    kernel: str = "auto"          # projection-free blocks on CUDA: "auto" (the generated kernel where the block is
                                  # memory-bound and fills the GPU, else measured), "always" (the generated kernel),
                                  # "measure" (the kernel where it measured faster than the compiler;
                                  # plans/choose.py)
    cudagraphs: bool = False      # replay each compiled graph as CUDA graphs (Inductor's cudagraph trees, what
                                  # mode="reduce-overhead" does): no host cost per call; the plan is then chosen
                                  # on GPU time alone. CUDA graphs' rules apply (static shapes, outputs reused)
    grad: str = "compiler"        # blocks whose output needs a gradient (grad enabled, an input requiring grad):
                                  # "compiler" leaves them to it (the fused op's backward recomputes the block
                                  # unfused in float32, far slower than the compiler's); "fuse" fuses them anyway
    inductor: dict | None = None  # Inductor config for the rest of the graph, as torch.compile(options=...) takes it
                                  # for the inductor backend, e.g. {"max_autotune": True}
    report: Any = None            # a fusednorm.report.Report to fill (used by fusednorm.explain)

    def __post_init__(self):
        if self.plan is None:
            self.plan = default_plan(self.cudagraphs)

    @classmethod
    def from_dict(cls, options: dict | None) -> "Options":
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            hint = ""
            if set(unknown) & ({"mode"} | _inductor_keys()):
                hint = ("; Inductor settings go in options={'inductor': {...}} (and CUDA graphs, as "
                        "mode='reduce-overhead' would give, are options={'cudagraphs': True})")
            raise ValueError(f"fusednorm: unknown backend option(s) {unknown}; known: "
                             f"{sorted(known - {'report'})}{hint}")
        opts = cls(**options)
        from .plans.choose import KERNEL_POLICIES, POLICIES

        if opts.plan not in POLICIES:
            raise ValueError(f"fusednorm: option plan={opts.plan!r}; expected one of {POLICIES}")
        if opts.kernel not in KERNEL_POLICIES:
            raise ValueError(f"fusednorm: option kernel={opts.kernel!r}; expected one of {KERNEL_POLICIES}")
        if opts.grad not in GRAD_POLICIES:
            raise ValueError(f"fusednorm: option grad={opts.grad!r}; expected one of {GRAD_POLICIES}")
        if opts.compiler not in COMPILERS:
            raise ValueError(f"fusednorm: option compiler={opts.compiler!r}; expected one of {COMPILERS}")
        if opts.inductor is not None:
            _check_inductor(opts)
        sm = opts.sm_count
        if sm is not None:
            if isinstance(sm, bool) or not isinstance(sm, numbers.Integral) or sm < 1:
                raise ValueError(f"fusednorm: option sm_count={sm!r}; expected None or a whole number >= 1")
            opts.sm_count = int(sm)  # numpy integers too; the op's schema takes a Python int
        if opts.dump_dir is not None and not isinstance(opts.dump_dir, (str, os.PathLike)):
            raise ValueError(f"fusednorm: option dump_dir={opts.dump_dir!r}; expected a folder path (str or Path)")
        if opts.report is not None:
            from .report import Report

            if not isinstance(opts.report, Report):
                raise ValueError(f"fusednorm: option report={opts.report!r}; expected a fusednorm.report.Report")
        for name in ("rewrite", "check_numerics", "cudagraphs"):
            if not isinstance(getattr(opts, name), bool):
                raise ValueError(f"fusednorm: option {name}={getattr(opts, name)!r}; expected True or False")
        if opts.cudagraphs and opts.check_numerics:
            raise ValueError("fusednorm: options cudagraphs=True and check_numerics=True do not go together: the "
                             "numerics check reads a flag on the host after every call, which a replayed CUDA graph "
                             "cannot do; drop one of them")
        if options.get("plan") is None:  # after the inductor option, which may turn cudagraphs on
            opts.plan = default_plan(opts.cudagraphs)
        if opts.dump_dir is None and os.environ.get("FUSEDNORM_DUMP"):
            opts.dump_dir = os.environ["FUSEDNORM_DUMP"]
        return opts


def default_plan(cudagraphs: bool) -> str:
    """The plan option where none is given: measured against the compiler when the graphs are replayed as CUDA
    graphs (docs/PERF.md §3: T5-base 7-9 % faster that way, blocks that lose stay with the compiler), else off."""
    return "measure" if cudagraphs else "never"


def _check_inductor(opts: Options) -> None:
    """The inductor option: a dict of known Inductor config keys, only with compiler="inductor"; its
    "triton.cudagraphs" is the cudagraphs option (so that the plan's weights are held for the graphs too)."""
    if not isinstance(opts.inductor, dict):
        raise ValueError(f"fusednorm: option inductor={opts.inductor!r}; expected a dict of Inductor config values")
    if opts.compiler != "inductor":
        raise ValueError(f"fusednorm: option inductor applies to compiler='inductor', not {opts.compiler!r}")
    unknown = sorted(set(opts.inductor) - _inductor_keys())
    if unknown:
        raise ValueError(f"fusednorm: option inductor: unknown Inductor config key(s) {unknown} "
                         "(torch._inductor.config lists them)")
    if opts.inductor.get("triton.cudagraphs"):
        opts.cudagraphs = True


def _inductor_keys() -> set[str]:
    from torch._inductor import config as inductor_config

    return set(inductor_config.get_config_copy())
