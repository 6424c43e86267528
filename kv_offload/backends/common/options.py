"""`storage_options`: a tier's settings, declared once as a dataclass and checked up front.

A tier declares its settings as a frozen dataclass whose fields say their kind with
``option(kind, default, doc)``; ``parse_options`` builds it from the ``storage_options`` dict of
the connector config. An unknown option, a missing required one, a wrong type or an impossible
value raises ``ConfigError`` naming the option, what was given and what is accepted, at
start-up, before anything connects.

Kinds: ``str`` (non-empty), ``optional_str`` (non-empty or None), ``size`` (bytes: an int or
"16GiB"), ``count`` (an int >= 1), ``optional_count`` (the same, or None), ``seconds`` (a
number >= 0), ``bool``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kv_offload.config import parse_size
from kv_offload.errors import ConfigError

T = TypeVar("T")


def option(kind: str, default: Any = dataclasses.MISSING, doc: str = "") -> Any:
    """A dataclass field that ``parse_options`` checks as ``kind``; no default: required."""
    if kind not in _KINDS:
        raise ValueError(f"unknown option kind {kind!r}; known: {sorted(_KINDS)}")
    return dataclasses.field(default=default, metadata={"kind": kind, "doc": doc})


def parse_options(cls: type[T], options: Mapping[str, Any] | None, *, tier: str,
                  **fixed: Any) -> T:
    """Build the settings dataclass ``cls`` of tier ``tier`` from ``storage_options``.

    ``fixed`` are fields the caller supplies (e.g. the layout fingerprint), not options.
    """
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"storage_options of storage_tier {tier!r} must be a dict, got "
                          f"{type(options).__name__}")
    declared = {f.name: f for f in dataclasses.fields(cls)
                if f.init and f.name not in fixed and "kind" in f.metadata}
    unknown = sorted(str(k) for k in options if k not in declared)
    if unknown:
        raise ConfigError(f"unknown storage_options {unknown} for storage_tier {tier!r}; "
                          f"accepted: {describe(cls, exclude=fixed)}")
    values = dict(fixed)
    for name, f in declared.items():
        if name not in options:
            if f.default is dataclasses.MISSING:
                raise ConfigError(f"storage_options.{name} is required for storage_tier "
                                  f"{tier!r} ({f.metadata['doc']})")
            continue
        values[name] = _KINDS[f.metadata["kind"]](f"storage_options.{name}", options[name])
    return cls(**values)


def check_remote_bounds(config: Any) -> None:
    """What every server-backed tier's config needs: the connector's layout fingerprint,
    and positive bounds on each wait (`timeout_s`, `request_timeout_s`,
    `connect_timeout_s`, `retry_interval_s`): a zero or negative one would wait forever or
    spin."""
    if not isinstance(config.layout_fingerprint, str) or not config.layout_fingerprint:
        raise ConfigError(f"layout_fingerprint must be a non-empty str, got "
                          f"{config.layout_fingerprint!r}")
    for name in ("timeout_s", "request_timeout_s", "connect_timeout_s", "retry_interval_s"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"storage_options.{name} must be > 0 (a bound on waiting), "
                              f"got {getattr(config, name)!r}")


def describe(cls: type, exclude: Mapping[str, Any] | None = None) -> str:
    """The accepted options of ``cls``, one 'name (kind, default)' each."""
    parts = []
    for f in dataclasses.fields(cls):
        if "kind" not in f.metadata or f.name in (exclude or {}):
            continue
        default = "required" if f.default is dataclasses.MISSING else f"default {f.default!r}"
        parts.append(f"{f.name} ({f.metadata['kind']}, {default})")
    return ", ".join(parts)


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _optional_str(name: str, value: Any) -> str | None:
    return None if value is None else _str(name, value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _nice(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise ConfigError(f"{name} must be an int from 0 to 19 (added to the engine's nice "
                          f"value: higher runs later when the CPUs are busy), got {value!r}")
    return value


def _optional_count(name: str, value: Any) -> int | None:
    return None if value is None else _count(name, value)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


_KINDS: dict[str, Callable[[str, Any], Any]] = {
    "str": _str, "optional_str": _optional_str, "size": parse_size, "count": _count,
    "optional_count": _optional_count, "seconds": _seconds, "bool": _bool,
    "nice": _nice,
}
