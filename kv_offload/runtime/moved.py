"""Old import paths of modules that moved (issue 44's layout), kept for one release.

`import kv_offload.tiering` (or `kv_offload.policies:ARCPolicy` in a config) still works: a
finder on `sys.meta_path` answers the old name with a thin module that forwards every
attribute to the module's new home and warns once, with a `DeprecationWarning` naming it.
The classes are the new module's own (same objects: `isinstance` and pickling see one
class). Nothing is imported until an old name is asked for. A class renamed with its move
(`RENAMED`: `CpuBackend` is `HostTier`) answers by its old name through the old paths too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

REMOVED_IN = "0.2"
MOVED: dict[str, str] = {  # old module -> its new home
    "kv_offload.affinity": "kv_offload.runtime.affinity",
    "kv_offload.faults": "kv_offload.runtime.faults",
    "kv_offload.secret_file": "kv_offload.runtime.secret_file",
    "kv_offload.tiering": "kv_offload.store.tiered",
    "kv_offload.tiering_jobs": "kv_offload.store.jobs",
    "kv_offload.tiering_loads": "kv_offload.store.loads",
    "kv_offload.tiering_stores": "kv_offload.store.stores",
    "kv_offload.tiering_probe": "kv_offload.store.probe",
    "kv_offload.manager": "kv_offload.store.manager",
    "kv_offload.policies": "kv_offload.store.policies",
    "kv_offload.key_view": "kv_offload.store.key_view",
    "kv_offload.generations": "kv_offload.store.generations",
    "kv_offload.read_rate": "kv_offload.store.read_rate",
    "kv_offload.startup_checks": "kv_offload.store.startup_checks",
    "kv_offload.tp_layout": "kv_offload.store.tp.layout",
    "kv_offload.tp_pages": "kv_offload.store.tp.pages",
    "kv_offload.tp_records": "kv_offload.store.tp.records",
    "kv_offload.tp_tier": "kv_offload.store.tp.tier",
    "kv_offload.backends.cpu": "kv_offload.store.host",
    "kv_offload.backends.cpu.backend": "kv_offload.store.host.tier",
    "kv_offload.backends.cpu.layer_copies": "kv_offload.store.host.layer_copies",
    "kv_offload.backends.cpu.pool": "kv_offload.store.host.pool",
    "kv_offload.backends.cpu.prefault": "kv_offload.store.host.prefault",
    "kv_offload.backends.cpu.slots": "kv_offload.store.host.slots",
    "kv_offload.backends.deadline": "kv_offload.backends.common.deadline",
    "kv_offload.backends.io_threads": "kv_offload.backends.common.io_threads",
    "kv_offload.backends.jobs": "kv_offload.backends.common.jobs",
    "kv_offload.backends.local_process": "kv_offload.backends.common.local_process",
    "kv_offload.backends.options": "kv_offload.backends.common.options",
    "kv_offload.backends.outage": "kv_offload.backends.common.outage",
    "kv_offload.backends.refresher": "kv_offload.backends.common.refresher",
    "kv_offload.backends.rejections": "kv_offload.backends.common.rejections",
    "kv_offload.backends.sealing": "kv_offload.backends.common.sealing",
    "kv_offload.backends.sealed_tier": "kv_offload.backends.common.sealed_tier",
    "kv_offload.backends.server_keys": "kv_offload.backends.common.server_keys",
    "kv_offload.backends.sized_read": "kv_offload.backends.common.sized_read",
    "kv_offload.backends.filesystem.changes": "kv_offload.backends.common.changes",
    "kv_offload.backends.filesystem.index": "kv_offload.backends.common.index",
    "kv_offload.backends.filesystem.listing": "kv_offload.backends.common.listing",
    "kv_offload.backends.filesystem.lru": "kv_offload.backends.common.lru",
    "kv_offload.backends.filesystem.pacing": "kv_offload.backends.common.pacing",
    # the connector's own modules (only kv_offload.vllm is configured; these for plug-ins'
    # and scripts' imports)
    "kv_offload.vllm.scheduler_side": "kv_offload.vllm.scheduler.offload_scheduler",
    "kv_offload.vllm.scheduler_recovery": "kv_offload.vllm.scheduler.offload_scheduler",
    "kv_offload.vllm.block_tables": "kv_offload.vllm.scheduler.block_tables",
    "kv_offload.vllm.in_step_loads": "kv_offload.vllm.scheduler.in_step_loads",
    "kv_offload.vllm.kv_events": "kv_offload.vllm.scheduler.kv_events",
    "kv_offload.vllm.mamba_states": "kv_offload.vllm.scheduler.mamba_states",
    "kv_offload.vllm.rank_keys": "kv_offload.vllm.scheduler.rank_keys",
    "kv_offload.vllm.report_lag": "kv_offload.vllm.scheduler.report_lag",
    "kv_offload.vllm.store_fence": "kv_offload.vllm.scheduler.store_fence",
    "kv_offload.vllm.worker_side": "kv_offload.vllm.worker.offload_worker",
    "kv_offload.vllm.worker_in_step": "kv_offload.vllm.worker.offload_worker",
    "kv_offload.vllm.worker_lifecycle": "kv_offload.vllm.worker.offload_worker",
    "kv_offload.vllm.worker_jobs": "kv_offload.vllm.worker.jobs",
    "kv_offload.vllm.worker_layers": "kv_offload.vllm.worker.layers",
    "kv_offload.vllm.exit_hook": "kv_offload.vllm.worker.exit_hook",
    "kv_offload.vllm.pump": "kv_offload.vllm.worker.pump",
}
# Names that changed with their module (old name -> new), answered through the old paths.
RENAMED: dict[str, str] = {
    "CpuBackend": "HostTier",  # one word for the idea: the host tier
}


class _Forward(types.ModuleType):
    """A module that is another module's old name: attributes come from the new one."""

    def __init__(self, old: str, new: types.ModuleType) -> None:
        super().__init__(old, new.__doc__)
        self._new = new

    def __getattr__(self, name: str) -> Any:
        if name in RENAMED:
            warnings.warn(f"{self.__name__}.{name} is now {self._new.__name__}."
                          f"{RENAMED[name]}; the old name goes in kv-offload {REMOVED_IN}",
                          DeprecationWarning, stacklevel=2)
            name = RENAMED[name]
        return getattr(self._new, name)

    def __dir__(self) -> list[str]:
        return dir(self._new)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        # (an old package, e.g. kv_offload.backends.cpu, has old submodules under it)
        package = any(old.startswith(fullname + ".") for old in MOVED)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old name goes in kv-offload "
                      f"{REMOVED_IN}: import {new}", DeprecationWarning, stacklevel=2)
        return _Forward(spec.name, importlib.import_module(new))

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Answer the old names (once per process), before any other finder: no file has them
    any more, and an editable install's finder would find a stale checkout's."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
