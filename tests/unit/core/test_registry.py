"""KVCacheSpecRegistry: MRO lookup, override, conflicts, errors, out-of-tree specs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kv_offload import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    KVCacheSpecRegistry,
    MambaSpec,
    MLAAttentionSpec,
    RegistryError,
    SlidingWindowSpec,
    UnregisteredSpecError,
    canonicalize,
    default_registry,
    register_kv_cache_spec,
)
from kv_offload.hit_rules import FULL_ATTENTION_HIT, MAMBA_HIT, SLIDING_WINDOW_HIT
from kv_offload.layouts import LayerPages, attention_layout, block_pages, mamba_layout

from helpers.byte_checks import assert_canonical_matches, fill_pattern

ATTN = dict(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)


@pytest.fixture
def registry():
    fresh = KVCacheSpecRegistry()
    fresh.register(FullAttentionSpec, layout=attention_layout, hit_rule=FULL_ATTENTION_HIT)
    fresh.register(MambaSpec, layout=mamba_layout, hit_rule=MAMBA_HIT)
    return fresh


def test_builtins_are_registered_at_import():
    assert default_registry.rules_for(MambaSpec).hit_rule is MAMBA_HIT
    assert default_registry.rules_for(SlidingWindowSpec).hit_rule is SLIDING_WINDOW_HIT
    assert default_registry.rules_for(MLAAttentionSpec).uniform_base is FullAttentionSpec


def test_unregistered_subclass_inherits_through_the_mro(registry):
    @dataclass(frozen=True, kw_only=True)
    class Child(FullAttentionSpec):
        extra: int = 0

    @dataclass(frozen=True, kw_only=True)
    class GrandChild(Child):
        pass

    assert registry.is_registered(GrandChild)
    assert registry.rules_for(GrandChild(**ATTN)).hit_rule is FULL_ATTENTION_HIT


def test_identical_reregistration_is_a_no_op_and_conflicts_are_errors(registry):
    registry.register(FullAttentionSpec, layout=attention_layout, hit_rule=FULL_ATTENTION_HIT)
    with pytest.raises(RegistryError, match="already registered with different \\['hit_rule'\\]"):
        registry.register(FullAttentionSpec, layout=attention_layout, hit_rule=MAMBA_HIT)


def test_uniform_base_must_be_a_superclass(registry):
    @dataclass(frozen=True, kw_only=True)
    class Odd(FullAttentionSpec):
        pass

    with pytest.raises(RegistryError, match="uniform_base MambaSpec must be Odd or one of its"):
        registry.register(Odd, uniform_base=MambaSpec)


def test_override_replaces_rules_of_a_registered_class(registry):
    registry.override(MambaSpec, hit_rule=FULL_ATTENTION_HIT)
    assert registry.rules_for(MambaSpec).hit_rule is FULL_ATTENTION_HIT
    with pytest.raises(UnregisteredSpecError, match="cannot override SlidingWindowSpec"):
        registry.override(SlidingWindowSpec, hit_rule=MAMBA_HIT)
    with pytest.raises(RegistryError, match="unknown rule\\(s\\) \\['colour'\\]"):
        registry.override(MambaSpec, colour="red")


def test_unregistered_spec_error_names_layer_and_type(registry):
    @dataclass(frozen=True)
    class Alien(KVCacheSpec):
        @property
        def real_page_size_bytes(self) -> int:
            return 64

    groups = [KVCacheGroup(["model.layers.7.mixer"], Alien(16))]
    with pytest.raises(UnregisteredSpecError) as info:
        registry.check(groups)
    assert "model.layers.7.mixer" in str(info.value) and "Alien" in str(info.value)
    assert "register_kv_cache_spec" in str(info.value)
    with pytest.raises(UnregisteredSpecError):
        canonicalize({}, groups, 2, registry=registry)


def test_new_class_without_a_registered_base_needs_explicit_rules(registry):
    @dataclass(frozen=True)
    class Alien(KVCacheSpec):
        pass

    with pytest.raises(RegistryError, match="pass layout= explicitly"):
        registry.register(Alien)


def test_is_uniform_uses_per_type_keys():
    full = FullAttentionSpec(**ATTN)
    mla = MLAAttentionSpec(**{**ATTN, "num_kv_heads": 1})
    w1 = SlidingWindowSpec(**ATTN, sliding_window=1024)
    w2 = SlidingWindowSpec(**ATTN, sliding_window=512)
    assert default_registry.is_uniform([full, mla])
    assert default_registry.is_uniform([w1, w1])
    assert not default_registry.is_uniform([w1, w2])
    assert not default_registry.is_uniform([full, w1])
    assert not default_registry.is_uniform([full, FullAttentionSpec(**{**ATTN, "block_size": 64})])


def test_out_of_tree_spec_with_padded_pages_canonicalises():
    """A platform spec defined outside the library, with its own layout rule:
    it stores pages padded to 4 KiB, as `[blocks, real]` int8 rows."""
    registry = KVCacheSpecRegistry()

    def padded_rows(name, cache, spec, num_blocks):
        offset, stride = block_pages(name, cache, spec, num_blocks, spec.real_page_size_bytes)
        return [LayerPages(cache, offset, stride, spec.real_page_size_bytes, spec.page_size_bytes)]

    @register_kv_cache_spec(layout=padded_rows, hit_rule=FULL_ATTENTION_HIT, registry=registry)
    @dataclass(frozen=True, kw_only=True)
    class PlatformSpec(FullAttentionSpec):
        alignment: int = 4096

        @property
        def page_size_bytes(self) -> int:
            return -(-self.real_page_size_bytes // self.alignment) * self.alignment

    spec = PlatformSpec(**{**ATTN, "block_size": 20})  # 2560-byte pages, 4096-byte slots
    buffer = torch.zeros(5 * 4096, dtype=torch.int8)
    caches = {"l0": buffer.as_strided((5, 2560), (4096, 1))}
    groups = [KVCacheGroup(list(caches), spec)]
    fill_pattern(caches, groups, 5)
    canonical = canonicalize(caches, groups, 5, registry=registry)
    ref = canonical.group_refs[0][0]
    assert (ref.page_size_bytes, ref.slot_bytes) == (2560, 4096)
    assert_canonical_matches(canonical, caches, groups)


def test_readme_example_registers_a_subclass():
    @register_kv_cache_spec()
    @dataclass(frozen=True, kw_only=True)
    class MyPlatformAttentionSpec(FullAttentionSpec):
        alignment: int = 4096

    assert default_registry.rules_for(MyPlatformAttentionSpec).uniform_base is \
        MyPlatformAttentionSpec
    assert default_registry.rules_for(MyPlatformAttentionSpec).hit_rule is FULL_ATTENTION_HIT
