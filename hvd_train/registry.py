"""How a model, a data set or a task is named and built: the one mechanism for those that ship and the user's own.

A name is either one that ships (`small_cnn`, `resnet18`, `timm/resnet50d`, `cifar10`, `classification`, ...) or
an import path, `package.module:attribute`, of the user's own factory (or task class). Both resolve to a callable
here, and every one is built the same way: called with keyword arguments, those facts of the run it names as
parameters (the data set's classes, channels, image size, ...) plus the user's `--model-args` (`--data-args`,
`--task-args`). A name that does not resolve gets one message naming the setting, whatever kind it is.
"""
import importlib
import inspect
import os
import sys
import traceback
from typing import Any, Callable, Mapping, Optional

from hvd_train.errors import ConfigError
from hvd_train.provenance import is_import_path

# Objects a user's script handed to hvd_train.train(), by the names the run records for them (hvd_train/api.py).
PROVIDED: dict[str, Callable[..., Any]] = {}


def resolve(name: str, find: Callable[[str], Optional[Callable[..., Any]]], flag: str,
            choices: str) -> Callable[..., Any]:
    """The factory `name` stands for: find(name) for a name that ships, else the attribute an import path names.
    `find` returns None for a name it does not know; `flag` is the setting and `choices` the names that ship, for
    the message."""
    if not is_import_path(name):
        factory = find(name)
        if factory is None:
            raise ConfigError(f"{flag}={name!r} is not known; {choices}, or give your own as package.module:name "
                              f"(importable from the working directory or PYTHONPATH)")
        return factory
    return import_attribute(name, flag)


def import_attribute(path: str, flag: str) -> Callable[..., Any]:
    """The object `package.module:attr.sub` names. The working directory comes last on the module search path,
    as a user's project is usually where the job is launched from; the app's own packages come first."""
    if path in PROVIDED:
        return PROVIDED[path]
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{flag}={path!r}: an import path is package.module:name, e.g. mymodels.net:build")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing module, or any error the module raised while it was imported
        where = traceback.extract_tb(e.__traceback__)[-1]
        detail = f"{type(e).__name__}: {e}"
        if not isinstance(e, ModuleNotFoundError):
            detail += f" (at {where.filename}:{where.lineno})"
        raise ConfigError(f"{flag}={path!r}: cannot import {module_name}: {detail}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n in vars(module) if not n.startswith("_"))
            raise ConfigError(f"{flag}={path!r}: {module_name} ({getattr(module, '__file__', '?')}) has no "
                              f"{attr!r}; it defines: {', '.join(defined) or 'nothing'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{flag}={path!r}: {attr} is a {type(obj).__name__}, not something to call")
    return obj


def takes(factory: Callable[..., Any], parameter: str) -> bool:
    """Whether factory names `parameter` (False where its signature cannot be read)."""
    try:
        return parameter in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def call(factory: Callable[..., Any], facts: Mapping[str, Any], args: Mapping[str, Any], flag: str, name: str,
         by_name_only: tuple[str, ...] = ()) -> Any:
    """factory(**the facts it names, **args). An argument in `args` it does not take, or a parameter without a
    default that neither gives, is refused with the setting named. by_name_only: facts read from a file, which a
    factory gets only where it names them (never through its **kwargs)."""
    return factory(**arguments(factory, facts, args, flag, name, by_name_only))


def arguments(factory: Callable[..., Any], facts: Mapping[str, Any], args: Mapping[str, Any], flag: str, name: str,
              by_name_only: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword arguments call() passes `factory` (the same checks and refusals): what a log line may show."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or extension callable without a signature: give it everything
        return {**{k: v for k, v in facts.items() if k not in by_name_only}, **args}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [n for n, p in params.items() if p.kind in by_name]
    unknown = [k for k in args if k not in named and not open_ended]
    if unknown:
        raise ConfigError(f"{flag}: {name} takes no argument {unknown[0]!r}; it takes: {', '.join(named) or 'none'}")
    kwargs = {k: v for k, v in facts.items() if k in named or (open_ended and k not in by_name_only)}
    kwargs.update(args)
    missing = [n for n in named if params[n].default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        known = ", ".join(f"{k}={v!r}" for k, v in facts.items()) or "none"
        raise ConfigError(f"{flag}: {name} needs {missing[0]!r}, which neither the run (it knows: {known}) nor the "
                          f"settings give; pass it in {flag}, e.g. {flag} {missing[0]}=VALUE")
    # In the order of the factory's parameters, then those its **kwargs takes: as its signature reads.
    return {**{n: kwargs[n] for n in named if n in kwargs}, **kwargs}
