"""No module of the Kubernetes backend holds mutable state: what the operator remembers lives in one `Runtime`
(k8s/process/runtime.py) and one `JobMemory` per job (k8s/cache/memory.py), made by `main()` or a test. A module-level
dict, list, set, lock or dataclass instance would be shared by every operator in the process (the integration tests run
several) and outlive a deleted job."""

from __future__ import annotations
import __future__

import contextlib
import dataclasses
import datetime
import enum
import importlib
import logging
import pkgutil
import re
import types
import typing
from typing import Any

import pytest

import seqtrain_operator.k8s as k8s

_SCALARS = (str, bytes, int, float, complex, bool, type(None), type(Ellipsis), enum.Enum, re.Pattern,
            logging.Logger, types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, typing.TypeVar,
            __future__._Feature, datetime.tzinfo)

# Read-only tables held in a mutable container, in modules whose owners have yet to freeze them (MappingProxyType,
# frozenset). Exempt by identity: the same object imported elsewhere is exempt there too. Nothing may join this list.
_NOT_YET_FROZEN: tuple[tuple[str, str], ...] = ()


def _exempt() -> set[int]:
    out = set()
    for module, name in _NOT_YET_FROZEN:
        with contextlib.suppress(ImportError, AttributeError):  # gone or renamed: nothing to exempt
            out.add(id(getattr(importlib.import_module(module), name)))
    return out


def _modules() -> list[str]:
    return sorted([k8s.__name__] + [m.name for m in pkgutil.walk_packages(k8s.__path__, k8s.__name__ + ".")])


def _immutable(value: Any, depth: int = 0) -> bool:
    """Whether `value` can hold no state: scalars, classes, functions, type aliases, frozen dataclasses and
    read-only containers of such."""
    if depth > 8:
        return False
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (typing._GenericAlias, types.GenericAlias, types.UnionType)):  # type: ignore[attr-defined]
        return True  # `Key = tuple[str, str]`, `EventSink = Callable[...]`
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v, depth + 1) for v in value)
    if isinstance(value, types.MappingProxyType):
        return all(_immutable(k, depth + 1) and _immutable(v, depth + 1) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        params = getattr(type(value), "__dataclass_params__", None)
        return bool(params and params.frozen) and all(
            _immutable(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    return False


def mutable_globals(module: types.ModuleType) -> list[str]:
    """`module.name (type)` for every module-level value that could hold state (dunder names are Python's own)."""
    exempt = _exempt()
    return [f"{module.__name__}.{name} ({type(value).__name__})" for name, value in vars(module).items()
            if not (name.startswith("__") and name.endswith("__")) and id(value) not in exempt
            and not _immutable(value)]


@pytest.mark.parametrize("name", _modules())
def test_no_module_of_the_backend_holds_mutable_state(name: str) -> None:
    found = mutable_globals(importlib.import_module(name))
    assert not found, (f"module-level mutable state: {', '.join(found)}; keep it in the Runtime "
                       "(k8s/process/runtime.py) or the job's JobMemory (k8s/cache/memory.py), or make it a constant "
                       "(tuple, MappingProxyType, frozen dataclass)")


def test_the_check_finds_what_the_backend_used_to_hold() -> None:
    import asyncio

    @dataclasses.dataclass
    class State:
        jobs: dict[str, int] = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        names: tuple[str, ...] = ("a",)

    mod = types.ModuleType("example")
    mod.STATE, mod._boosts, mod._LOCK, mod._seen = State(), {}, asyncio.Lock(), set()  # type: ignore[attr-defined]
    mod.OK, mod.NAMES, mod.KEY = Frozen(), types.MappingProxyType({"a": 1}), tuple[str, str]  # type: ignore[attr-defined]
    mod.FROZEN_HOLDING_A_DICT = dataclasses.make_dataclass(  # type: ignore[attr-defined]
        "F", [("d", dict)], frozen=True)(d={})
    found = {s.split(" ")[0] for s in mutable_globals(mod)}
    assert found == {"example.STATE", "example._boosts", "example._LOCK", "example._seen",
                     "example.FROZEN_HOLDING_A_DICT"}
