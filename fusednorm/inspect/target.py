"""What `python -m fusednorm explain TARGET` runs: a callable that builds a model and its inputs.

TARGET is one of
    path/to/file.py            the file's build()
    path/to/file.py:make       the file's make()
    package.module             the module's build()
    package.module:make        the module's make()
The callable takes no arguments and returns (model, args) or (model, args, kwargs): args a tuple (or list) of
positional inputs, kwargs a dict of keyword inputs, exactly as the model is called.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

DEFAULT_CALLABLE = "build"


class TargetError(ValueError):
    """TARGET does not name a usable builder; the message says what is wrong."""


def split_target(target: str) -> tuple[str, str]:
    """'where[:name]' -> (where, name); a Windows drive letter's colon is not a separator."""
    where, sep, name = target.rpartition(":")
    if not sep or not name or os.sep in name or "/" in name or len(where) <= 1:
        return target, DEFAULT_CALLABLE
    return where, name


def load_builder(target: str):
    where, name = split_target(target)
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _module_from_file(where)
    else:
        module = _module_from_name(where)
    builder = getattr(module, name, None)
    if builder is None:
        raise TargetError(f"{where} defines no {name}(); define {name}() returning (model, args) or "
                          "(model, args, kwargs)")
    if not callable(builder):
        raise TargetError(f"{where}:{name} is a {type(builder).__name__}, not a callable")
    return builder


def build(target: str):
    """(model, args, kwargs) from TARGET's callable, checked."""
    builder = load_builder(target)
    label = f"{target if ':' in target else target + ':' + DEFAULT_CALLABLE}"
    try:
        built = builder()
    except Exception as e:
        raise TargetError(f"{label}() raised {type(e).__name__}: {e}") from e
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise TargetError(f"{label}() must return (model, args) or (model, args, kwargs), "
                          f"got {_describe(built)}")
    model, args, kwargs = (*built, {}) if len(built) == 2 else built
    if not callable(model):
        raise TargetError(f"{label}(): the model (first item) must be callable, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TargetError(f"{label}(): args (second item) must be a tuple or list of inputs, "
                          f"got {type(args).__name__}; wrap a single input as (x,)")
    if not isinstance(kwargs, dict):
        raise TargetError(f"{label}(): kwargs (third item) must be a dict, got {type(kwargs).__name__}")
    return model, tuple(args), kwargs


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"a {type(value).__name__}"


def _module_from_file(path: str):
    if not os.path.isfile(path):
        raise TargetError(f"no such file: {path}")
    name = "_fusednorm_target_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses and pickling look a module up by name
    # the file's own folder first, so it imports its neighbours as when run as a script
    with _on_path(os.path.dirname(os.path.abspath(path))):
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise TargetError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _module_from_name(name: str):
    with _on_path(os.getcwd()):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                raise TargetError(f"no module named {name!r} (a file path must end in .py)") from e
            raise TargetError(f"importing {name} failed: {type(e).__name__}: {e}") from e
        except Exception as e:
            raise TargetError(f"importing {name} failed: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _on_path(folder: str):
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
