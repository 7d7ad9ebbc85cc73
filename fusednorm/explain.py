"""fusednorm.explain(model, *args, **kwargs): what the backend fuses in a model, and what it leaves alone and why.

The model is compiled with the fusednorm backend (the rest of each graph runs eagerly, so this is quick), run once
on the inputs under torch.no_grad(), and the report of every graph Dynamo made is returned. Dynamo's cache entries
made for this are dropped afterwards, so the user's own compiled functions see no trace of it.
"""
from __future__ import annotations

import contextlib
import inspect
import types

import torch

from .report import Report
from .warn import warn_once


class ExplainError(RuntimeError):
    """The model could not be run on the given inputs (the cause is chained)."""


def explain(model, *args, **kwargs) -> Report:
    """Compile `model` with the fusednorm backend, run it once on (*args, **kwargs), return the filled Report."""
    return explain_call(model, args, kwargs)


def explain_call(model, args=(), kwargs=None, *, dump_dir: str | None = None, dynamic: bool | None = None) -> Report:
    """explain() with its own settings: dump_dir (as FUSEDNORM_DUMP), dynamic (as in torch.compile)."""
    if not callable(model):
        raise TypeError(f"fusednorm.explain: model must be an nn.Module or a callable, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"fusednorm.explain: args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"fusednorm.explain: kwargs must be a dict, got {type(kwargs).__name__}")
    from .inspect.kernels import collecting
    from .options import Options

    report = Report()
    options = {"compiler": "eager", "rewrite": True, "report": report}
    if dump_dir:
        options["dump_dir"] = dump_dir
    dump_to = Options.from_dict(options).dump_dir   # the option, else FUSEDNORM_DUMP

    def backend(gm, example_inputs):   # a backend of its own: its cache entries are told apart from the user's
        from .backend import fusednorm_backend

        report.graphs += 1
        return fusednorm_backend(gm, example_inputs, options=options)

    compiled = torch.compile(_fresh(_call), backend=backend, dynamic=dynamic, **_isolated())
    kernels: list = []
    try:
        with _compile_stance(), torch.no_grad(), collecting(kernels), _counters_kept():
            compiled(model, tuple(args), dict(kwargs or {}))
    except Exception as e:
        raise ExplainError(f"fusednorm.explain: running the model on the given inputs failed: "
                           f"{type(e).__name__}: {e}") from e
    finally:
        try:
            _forget(backend, _region(compiled))
        except Exception as e:   # Dynamo internals moved: entries stay behind, harmless but not tidy
            warn_once(f"fusednorm.explain: could not drop its Dynamo cache entries ({type(e).__name__}: {e})")
    report.kernels += kernels
    if dump_to:
        from .inspect.dump import dump_report

        dump_report(dump_to, report)
    return report


def _call(model, args, kwargs):
    return model(*args, **kwargs)


def _fresh(fn):
    """A copy of fn with a code object of its own: Dynamo keeps its cache entries on the code object, so entries
    made for this explain die with the copy instead of piling up on code the user's compiled models share.

    The copy is filed under Dynamo's own trampoline module, whose frames Dynamo leaves out of the source lines it
    records: a report then points at the model's code, never at this file."""
    from torch._dynamo import external_utils

    code = fn.__code__.replace(co_filename=inspect.getfile(external_utils))
    return types.FunctionType(code, fn.__globals__, fn.__name__)


def _isolated() -> dict:
    """Where torch.compile can keep this compile's recompiles apart from the user's, ask it to."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True}
    return {}


def _compile_stance():
    """Compile even when the user set torch.compiler.set_stance("force_eager") around the call."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("default") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _counters_kept():
    """Dynamo's global counters (graph breaks, unique graphs ...) read as if explain had not run."""
    from torch._dynamo.utils import counters

    saved = {name: counter.copy() for name, counter in counters.items()}
    try:
        yield
    finally:
        counters.clear()
        for name, counter in saved.items():
            counters[name].update(counter)


def _forget(backend, region: int) -> None:
    """Drop Dynamo's cache entries compiled by `backend`, and its hold on the backend, leaving all others."""
    try:
        from torch._dynamo import convert_frame, eval_frame
        from torch._dynamo.guards import DeletedGuardManagerWrapper
    except ImportError:
        return
    for weak_code in convert_frame.input_codes.seen + convert_frame.output_codes.seen:
        code = weak_code()
        if code is None:
            continue
        for entry in _entries(code, region):   # an entry listed twice is matched once: invalidating clears its backend
            if getattr(entry.backend, "compiler_fn", entry.backend) is backend:
                manager = entry.guard_manager
                extra_state = getattr(manager, "extra_state", None)
                if extra_state is not None:
                    extra_state.invalidate(entry, DeletedGuardManagerWrapper("fusednorm.explain is done"))
    for key, value in list(eval_frame.cached_backends.items()):
        if getattr(value, "compiler_fn", value) is backend:
            del eval_frame.cached_backends[key]


def _entries(code, region: int) -> list:
    """The code object's cache entries: the shared list, and the isolated region's where there is one."""
    from torch._dynamo import eval_frame

    entries = list(eval_frame._debug_get_cache_entry_list(code))
    by_region = getattr(eval_frame, "_get_cache_entries_for_region", None)
    if by_region is not None and region >= 0:
        entries += by_region(code, region)
    return entries


def _region(compiled) -> int:
    """The isolated-recompiles region torch.compile gave `compiled` (-1: none)."""
    ctx = getattr(compiled, "dynamo_ctx", None)   # an OptimizedModule keeps it on its context
    region = getattr(ctx, "_isolate_recompiles_id", getattr(compiled, "_isolate_recompiles_id", -1))
    return region if isinstance(region, int) else -1
