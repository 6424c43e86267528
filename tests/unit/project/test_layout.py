"""The package's folders are its architecture (docs/architecture.md): imports point one way,
runtime <- core <- kernels <- backends <- store <- vllm <- tools/serving/testing; no two
modules import each other at import time; the scheduler side never touches tensors or tiers;
the top level of `kv_offload/` is what a user imports. Read from the source (ast), so a
function-level import counts as much as one at the top of a module."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "kv_offload"
LAYERS = {"errors": 0, "runtime": 0, "core": 1, "kernels": 2, "backends": 3, "store": 4,
          "vllm": 5, "tools": 6, "serving": 6, "testing": 6}  # (errors imports nothing)
# Upward imports not yet untangled, each with what it needs (none left: the checks config
# ran at parse time are store/startup_checks.py's check_config).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def layer(module: str) -> int:
    """kv_offload.X.… is in layer X when X is a layer's folder, else in the core."""
    parts = module.split(".")
    return LAYERS.get(parts[1], LAYERS["core"]) if len(parts) > 1 else LAYERS["core"]


def imports(module: str, *, top_level_only: bool = False) -> set[str]:
    """The kv_offload modules `module` imports (submodules named in `from X import y`)."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kv_offload")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("kv_offload"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    found.discard(module)
    return found


def test_the_top_level_is_what_a_user_imports():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    assert not [m for m in top if "_" in m and m.split("_")[0] in {"tiering", "tp"}], top


def test_imports_point_one_way():
    upward = {(m, d) for m in MODULES for d in imports(m)
              if d in MODULES and layer(d) > layer(m)}
    assert sorted(upward - KNOWN_UPWARD.keys()) == [], "modules importing a layer above theirs"
    assert sorted(KNOWN_UPWARD.keys() - upward) == [], "fixed: drop them from KNOWN_UPWARD"


def test_the_runtime_imports_nothing_but_errors():
    for m in MODULES:
        if m.startswith("kv_offload.runtime"):
            assert imports(m) <= {"kv_offload.errors", *(x for x in MODULES
                                                        if x.startswith("kv_offload.runtime"))}, m


def test_the_scheduler_side_never_touches_tensors_kernels_stores_or_tiers():
    for m, path in MODULES.items():
        if not m.startswith("kv_offload.vllm.scheduler"):
            continue
        tree = ast.parse(path.read_text())
        named = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        named |= {n.module for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module}
        bad = [x for x in named if x.split(".")[0] in {"torch", "numpy"} or
               x.startswith(("kv_offload.kernels", "kv_offload.store", "kv_offload.backends"))]
        assert bad == [], (m, bad)


TIERS = ("filesystem", "valkey", "s3", "example")


def test_the_tiers_never_import_each_other():
    """What two tiers need lives in backends/common/, never in one of them."""
    crossing = sorted((m, d) for m in MODULES for d in imports(m) for tier in TIERS
                      for other in TIERS if other != tier and
                      m.startswith(f"kv_offload.backends.{tier}") and
                      d.startswith(f"kv_offload.backends.{other}"))
    assert crossing == []
    common = [(m, d) for m in MODULES if m.startswith("kv_offload.backends.common")
              for d in imports(m) if d.startswith(tuple(f"kv_offload.backends.{t}"
                                                        for t in TIERS))]
    assert common == [], "common/ is shared by the tiers: it imports none of them"


def test_the_backends_folder_holds_the_contract_records_common_and_the_tiers():
    folder = PACKAGE / "backends"
    modules = sorted(p.stem for p in folder.glob("*.py"))
    assert modules == ["__init__", "base", "namespaced", "record"]  # (the contract, with
    # namespaced: how StorageTier.from_options keeps a plug-in's layouts apart)
    packages = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(["common", *TIERS])


def test_no_two_modules_import_each_other_at_import_time():
    graph = {m: {d for d in imports(m, top_level_only=True) if d in MODULES} for m in MODULES}
    # a package importing its own submodules (re-exports) is how packages work: not a circle
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if d.startswith(m + "."):
                continue
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("old, new", [
    ("kv_offload.tiering", "kv_offload.store.tiered"),
    ("kv_offload.policies", "kv_offload.store.policies"),
    ("kv_offload.backends.cpu", "kv_offload.store.host"),
    # old names inside packages that still exist (the finder comes first on sys.meta_path)
    ("kv_offload.backends.sealing", "kv_offload.backends.common.sealing"),
    ("kv_offload.backends.filesystem.index", "kv_offload.backends.common.index"),
])
def test_an_old_import_path_still_works_and_says_where_the_module_went(old, new):
    import importlib

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        moved = importlib.import_module(old)
    target = importlib.import_module(new)
    name = next(n for n in dir(target) if not n.startswith("_") and
                isinstance(getattr(target, n), type))
    assert getattr(moved, name) is getattr(target, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module(old)  # (once: the module is cached)


def test_an_old_name_inside_a_package_that_still_exists_is_the_new_module_s():
    """`from kv_offload.backends import sealing` and `from kv_offload.backends.filesystem
    import pacing` (their packages still exist, with other modules) reach the moved module;
    every moved name maps to a module that imports."""
    import importlib

    from kv_offload.runtime.moved import MOVED

    for old in ("kv_offload.backends.sealing", "kv_offload.backends.filesystem.pacing"):
        sys.modules.pop(old, None)
        parent, _, leaf = old.rpartition(".")
        vars(importlib.import_module(parent)).pop(leaf, None)
    with pytest.warns(DeprecationWarning, match="kv_offload.backends.sealing moved to"):
        from kv_offload.backends import sealing
    with pytest.warns(DeprecationWarning, match="filesystem.pacing moved to"):
        from kv_offload.backends.filesystem import pacing
    from kv_offload.backends.common import pacing as new_pacing
    from kv_offload.backends.common import sealing as new_sealing

    assert sealing.make_codec is new_sealing.make_codec
    assert pacing.Pacer is new_pacing.Pacer
    for new in MOVED.values():
        importlib.import_module(new)


def test_a_class_renamed_with_its_move_answers_by_its_old_name_through_the_old_path():
    import importlib

    from kv_offload.store.host import HostTier

    sys.modules.pop("kv_offload.backends.cpu", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the module's own warning: tested above)
        old = importlib.import_module("kv_offload.backends.cpu")
    with pytest.warns(DeprecationWarning, match="CpuBackend is now kv_offload.store.host"):
        assert old.CpuBackend is HostTier


def test_no_class_is_cut_into_mixins():
    """A class is one file that owns its parts (composition): no class is named or
    documented as a mixin, and no class has more than one base of ours."""
    ours = {n.name for path in MODULES.values()
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    found = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            doc = (ast.get_docstring(node) or "").lower()
            bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in ours]
            if "mixin" in node.name.lower() or "a mixin" in doc or len(bases) > 1:
                found.append((m, node.name))
        module_doc = (ast.get_docstring(ast.parse(path.read_text())) or "").lower()
        if "mixin of" in " ".join(module_doc.split()):
            found.append((m, "module docstring"))
    assert found == []
