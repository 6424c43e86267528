"""The negative control of the Mamba e2e tests: a KVOffloadConnector that never restores
Mamba-type states.

vLLM loads it like ours (`kv_connector: "NoStateRestoreConnector"`,
`kv_connector_module_path: "no_state_restore"`; this directory is on the engine's path).
It offers and loads the same hits, attention blocks included, but drops the Mamba-type
groups from every load plan, so those requests run from whatever the state block held.
A test whose model ignored its recurrent state would pass with it; the Mamba tests
require that it changes the outputs.
"""

from __future__ import annotations

from typing import Any

from kv_offload.specs import MambaSpec
from kv_offload.vllm import KVOffloadConnector


class NoStateRestoreConnector(KVOffloadConnector):
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        scheduler = self._scheduler
        plan = scheduler._plan.loads.get(request.request_id)
        if plan is None:
            return
        for g, spec in enumerate(scheduler.specs):
            if isinstance(spec, MambaSpec):
                plan.pop(g, None)
