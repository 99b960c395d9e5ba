"""The user's own code, named as `package.module:function` or `path/to/file.py:function`.

A module name is imported as Python would, then, failing that, from the current folder (as `uvicorn app:app`
does). The folder goes at the end of the import path, so a local file never shadows an installed package such as
torch. A file path is loaded as a module of its own, once per file.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch

from memfit.core.errors import MemfitError
from memfit.specs.live import is_live, lookup

if TYPE_CHECKING:
    from importlib.abc import Loader


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:function` (a file), as opposed to `package.module:function`."""
    return spec.partition(":")[0].endswith(".py")


def cache_key(spec: str | None) -> str | None:
    """`spec` as a key that names one function wherever the process runs from (a file spec's absolute path)."""
    if spec is None or not is_file_spec(spec):
        return spec
    path, _, name = spec.rpartition(":")
    return f"{os.path.abspath(path)}:{name}"


def import_callable(spec: str | None, what: str) -> Callable:
    """The function `spec` names, or a one-line MemfitError saying what is wrong."""
    if is_live(spec):
        return lookup(spec)
    if not isinstance(spec, str) or ":" not in spec or not all(spec.partition(":")[::2]):
        raise MemfitError(f"{what} {spec!r} must look like package.module:function or path/file.py:function.")
    location, _, attr = spec.partition(":")
    module = _load_file(location, what, spec) if is_file_spec(spec) else _import_module(location, what, spec)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise MemfitError(f"{location!r} has no callable {attr!r} ({what} {spec!r}).")
    return fn


def call_user(fn: Callable, spec: str | None, what: str, *args, **kwargs):
    """fn(*args, **kwargs); the user's exception becomes one line naming where in their code it was raised (an
    out-of-memory error passes through: it is what a measurement reports)."""
    try:
        return fn(*args, **kwargs)
    except (MemfitError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # the user's code failed: say where, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        shape_from_values = any(word in type(exc).__name__ for word in ("DataDependent", "DynamicOutputShape"))
        hint = (" (a traced estimate runs on fake tensors, which hold no values: an op whose output depends on them "
                "cannot be traced; measure it, or move that line out)") if shape_from_values else ""
        raise MemfitError(f"{what} {spec!r} failed{user_line(exc, fn)}: {type(exc).__name__}: {first}{hint}") from None


def user_line(exc: BaseException, fn: Callable) -> str:
    """' at file.py:LINE (code)' for the deepest frame of `exc` in the file that defines `fn`, or ''."""
    code = getattr(fn, "__code__", None)
    return _line_in(exc, code.co_filename) if code is not None else ""


def _line_in(exc: BaseException, filename: str) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {os.path.basename(frame.filename)}:{frame.lineno} ({(frame.line or '').strip()})"


def _import_module(name: str, what: str, spec: str) -> ModuleType:
    if os.getcwd() not in sys.path and importlib.util.find_spec(name.split(".")[0]) is None:
        sys.path.append(os.getcwd())   # after the installed packages: a local file cannot shadow them
        importlib.invalidate_caches()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.split(".")[0] == exc.name.split(".")[0]:   # not there, not its import
            raise MemfitError(f"cannot import {name!r} for {what} {spec!r}: no module {exc.name!r} installed or in "
                              f"the current folder ({os.getcwd()}); a file can be named as path/to/file.py:function."
                              ) from None
        raise MemfitError(f"cannot import {name!r} for {what} {spec!r}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # any import failure is the user's module failing
        raise MemfitError(f"cannot import {name!r} for {what} {spec!r}: {type(exc).__name__}: {exc}") from None


def _load_file(path: str, what: str, spec: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise MemfitError(f"no file {path!r} for {what} {spec!r} (relative paths start at the current folder, "
                          f"{os.getcwd()}).")
    name = "memfit_user_" + hashlib.sha1(full.encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    assert module_spec is not None   # a .py file: its source loader's spec
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module   # before running it: dataclasses and pickling look the module up
    try:
        cast("Loader", module_spec.loader).exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise MemfitError(f"cannot load {path!r} for {what} {spec!r}{_line_in(exc, full)}: "
                          f"{type(exc).__name__}: {exc}") from None
    return module
