"""KVCacheSpecRegistry: each spec class -> the rules the rest of the library follows.

A rule set says how a layer of that spec becomes canonical pages (`layout`),
which blocks must be cached for a prefix hit (`hit_rule`), and which specs may
share a group (`uniform_base` + `uniform_key`). Lookup walks the MRO, so a
subclass nobody registered inherits its parent's rules; out-of-tree spec types
register with the `register_kv_cache_spec` decorator.

Every file a new spec type touches (a built-in one; an out-of-tree type writes the same
pieces in its own package and registers them with `register_kv_cache_spec` and
`register_vllm_spec`):

- the spec: `kv_offload/specs.py` (the dataclass with vLLM's field names, its
  `page_size_bytes`, its merge rule) and its export in `kv_offload/__init__.py`;
- the hit rule: `kv_offload/hit_rules.py` (which blocks a prefix hit must have cached);
- the layout rule: `kv_offload/layouts.py` (how one layer's engine cache becomes pages), when
  neither `attention_layout` nor `mamba_layout` fits;
- the registration: `kv_offload/builtin_rules.py` (layout, hit rule, `uniform_base`,
  `uniform_key`);
- the vLLM translation: `kv_offload/vllm/spec_translation.py` (vLLM's spec class name -> ours,
  or a translator for fields that differ; anything unmodelled stays refused);
- the tests: `tests/unit/core/test_specs.py`, `tests/unit/core/test_registry.py`,
  `tests/hybrid/hit_reference.py` (an independent reference of the hit semantics) with
  `tests/hybrid/test_hits.py`, `tests/unit/vllm/test_spec_translation.py`, and an example
  model in `kv_offload/testing/example_models.py` (canonicalised and copied by the kernel
  tests and `kv-offload inspect`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kv_offload.errors import RegistryError, UnregisteredSpecError
from kv_offload.specs import KVCacheGroup, KVCacheSpec, UniformTypeKVCacheSpecs

if TYPE_CHECKING:
    from kv_offload.hit_rules import HitRule
    from kv_offload.layouts import LayoutRule

SpecT = TypeVar("SpecT", bound=type[KVCacheSpec])


def no_uniform_key(spec: KVCacheSpec) -> Hashable:
    """Default `uniform_key`: any two specs of the same base may share a group."""
    return None


@dataclass(frozen=True)
class SpecRules:
    """What the library needs to know about one spec class."""

    layout: LayoutRule
    hit_rule: HitRule
    uniform_base: type[KVCacheSpec]
    uniform_key: Callable[[KVCacheSpec], Hashable] = no_uniform_key


class KVCacheSpecRegistry:
    """Maps spec classes to `SpecRules`. One default instance is shared process-wide."""

    def __init__(self) -> None:
        self._rules: dict[type[KVCacheSpec], SpecRules] = {}

    def register(
        self,
        spec_cls: type[KVCacheSpec],
        *,
        layout: LayoutRule | None = None,
        hit_rule: HitRule | None = None,
        uniform_base: type[KVCacheSpec] | None = None,
        uniform_key: Callable[[KVCacheSpec], Hashable] | None = None,
    ) -> SpecRules:
        """Register a new spec class. Omitted rules are inherited from the nearest
        registered base class. Re-registering with identical rules is a no-op;
        with different rules it is an error (use `override`)."""
        if not (isinstance(spec_cls, type) and issubclass(spec_cls, KVCacheSpec)):
            raise RegistryError(f"can only register KVCacheSpec subclasses, got {spec_cls!r}")
        inherited = self._inherited(spec_cls)
        rules = SpecRules(
            layout=layout or _inherit(inherited, "layout", spec_cls),
            hit_rule=hit_rule or _inherit(inherited, "hit_rule", spec_cls),
            uniform_base=uniform_base or spec_cls,
            uniform_key=uniform_key or (inherited.uniform_key if inherited else no_uniform_key),
        )
        if not issubclass(spec_cls, rules.uniform_base):
            raise RegistryError(
                f"{spec_cls.__name__}: uniform_base {rules.uniform_base.__name__} must be "
                f"{spec_cls.__name__} or one of its base classes"
            )
        existing = self._rules.get(spec_cls)
        if existing is not None and existing != rules:
            changed = [f.name for f in fields(SpecRules) if getattr(existing, f.name) !=
                       getattr(rules, f.name)]
            raise RegistryError(
                f"{spec_cls.__name__} is already registered with different {changed}; "
                f"use KVCacheSpecRegistry.override to replace its rules"
            )
        self._rules[spec_cls] = rules
        return rules

    def override(self, spec_cls: type[KVCacheSpec], **changes: Any) -> SpecRules:
        """Replace some rules of an already registered class (e.g. a platform that
        pads pages differently). Names the rules that may be changed on error."""
        if spec_cls not in self._rules:
            raise UnregisteredSpecError(
                f"cannot override {spec_cls.__name__}: it is not registered itself "
                f"(register it first)"
            )
        allowed = {f.name for f in fields(SpecRules)}
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise RegistryError(f"unknown rule(s) {unknown}; rules are {sorted(allowed)}")
        rules = replace(self._rules[spec_cls], **changes)
        if not issubclass(spec_cls, rules.uniform_base):
            raise RegistryError(
                f"{spec_cls.__name__}: uniform_base {rules.uniform_base.__name__} is not a "
                f"base class of it"
            )
        self._rules[spec_cls] = rules
        return rules

    def is_registered(self, spec_cls: type[KVCacheSpec]) -> bool:
        """True when the class or one of its bases has rules."""
        return self._inherited(spec_cls) is not None

    def rules_for(self, spec: KVCacheSpec | type[KVCacheSpec]) -> SpecRules:
        """The rules of a spec (instance or class), found through the MRO."""
        spec_cls = spec if isinstance(spec, type) else type(spec)
        rules = self._inherited(spec_cls)
        if rules is None:
            raise UnregisteredSpecError(_unregistered_message(spec_cls))
        return rules

    def is_uniform(self, specs: Iterable[KVCacheSpec]) -> bool:
        """Whether these specs may share one group: same block size, same uniform
        base, and the same per-type key (e.g. equal sliding windows)."""
        specs = list(specs)
        if not specs:
            return True
        first = self.rules_for(specs[0])
        for spec in specs:
            rules = self.rules_for(spec)
            if spec.block_size != specs[0].block_size or not isinstance(spec, first.uniform_base):
                return False
            if rules.uniform_base is not first.uniform_base:
                return False
            if rules.uniform_key(spec) != first.uniform_key(specs[0]):
                return False
        return True

    def check(self, groups: Sequence[KVCacheGroup]) -> None:
        """Raise UnregisteredSpecError naming the first layer whose spec has no rules."""
        for index, group in enumerate(groups):
            for layer in group.layer_names:
                spec = group.layer_spec(layer)
                if isinstance(spec, UniformTypeKVCacheSpecs) or not self.is_registered(type(spec)):
                    raise UnregisteredSpecError(
                        f"layer {layer!r} of cache group {index}: "
                        + _unregistered_message(type(spec))
                    )

    def _inherited(self, spec_cls: type[KVCacheSpec]) -> SpecRules | None:
        for base in spec_cls.__mro__:
            rules = self._rules.get(base)
            if rules is not None:
                return rules
        return None


def _inherit(inherited: SpecRules | None, rule: str, spec_cls: type) -> Any:
    if inherited is None:
        raise RegistryError(
            f"{spec_cls.__name__} has no registered base class to inherit `{rule}` from; "
            f"pass {rule}= explicitly"
        )
    return getattr(inherited, rule)


def _unregistered_message(spec_cls: type) -> str:
    return (
        f"spec type {spec_cls.__module__}.{spec_cls.__qualname__} is not registered and "
        f"has no registered base class; register it with "
        f"@kv_offload.register_kv_cache_spec(layout=..., hit_rule=...) or subclass a "
        f"built-in spec such as FullAttentionSpec or MambaSpec"
    )


default_registry = KVCacheSpecRegistry()


def register_kv_cache_spec(
    *,
    layout: LayoutRule | None = None,
    hit_rule: HitRule | None = None,
    uniform_base: type[KVCacheSpec] | None = None,
    uniform_key: Callable[[KVCacheSpec], Hashable] | None = None,
    registry: KVCacheSpecRegistry | None = None,
) -> Callable[[SpecT], SpecT]:
    """Class decorator: register a spec class (rules not given are inherited)."""

    def decorate(spec_cls: SpecT) -> SpecT:
        (registry or default_registry).register(
            spec_cls,
            layout=layout,
            hit_rule=hit_rule,
            uniform_base=uniform_base,
            uniform_key=uniform_key,
        )
        return spec_cls

    return decorate
