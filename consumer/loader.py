"""Resolves `--model MODULE:ATTR` into a callable batch model.

ATTR names either a model (called with the list of payloads of a batch, returning a list
of results of the same length) or a zero-argument factory, a class or a function, that
returns one. `--model-arg key=value` pairs are passed to the factory as keyword
arguments. MODULE is imported from the working directory and PYTHONPATH.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from scheduler_core.errors import InvalidRequest

BatchModel = Callable[[list[Any]], list[Any]]


def _is_factory(obj: Any) -> bool:
    if inspect.isclass(obj):
        return True
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        params = inspect.signature(obj).parameters.values()
        required = [p for p in params if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return not required
    return False


def load_model(spec: str, kwargs: dict[str, Any] | None = None) -> BatchModel:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidRequest("model", f"{spec!r} is not of the form MODULE:ATTR")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidRequest("model", f"cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidRequest("model", f"module {module_name!r} has no {attr!r}") from None
    if _is_factory(target):
        try:
            target = target(**(kwargs or {}))
        except TypeError as exc:
            raise InvalidRequest("model_arg", f"{spec} does not take these arguments "
                                              f"({sorted(kwargs or {})}): {exc}") from exc
    elif kwargs:
        raise InvalidRequest("model_arg", f"{spec} is a model, not a factory: it takes no "
                                          "--model-arg")
    if not callable(target):
        raise InvalidRequest("model", f"{spec} resolved to {type(target).__name__}, which is "
                                      "not callable with a batch")
    return target
