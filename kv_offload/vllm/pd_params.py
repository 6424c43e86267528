"""What a prefill server tells a decode server through vLLM's `kv_transfer_params`.

Prefill/decode disaggregation on vLLM's own request flow: a proxy sends the prefill server
the request with `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`;
the connector's `request_finished` returns the params that come back in the response
(`promise_for`); the proxy sends the decode server the request with them, where they
reach the connector's lookup as `request.kv_transfer_params` (`promise_of`). The KV itself
goes through the storage tier both servers share: no connection between the two engines.

The promise, under the key `"kv_offload"`:
- `tokens`: the prompt tokens whose blocks the prefill server stored or is storing (the
  longest hit its own reports and planned stores give), what the decode side waits for;
- `identity`: the prefill server's record identity (weights, config and TP-free layout,
  hashed: `RankReport.identity`); a decode server with another identity cannot read those
  records (another model, or a layout its ranks do not share) and does not wait;
- `version`: this format's number (a decode server that does not know it ignores it).
Nothing in it is trusted for bytes: the records themselves are verified as always, so a
forged promise costs at most one bounded wait (`remote_wait_s`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARAMS_KEY = "kv_offload"
VERSION = 1


@dataclass(frozen=True)
class RemotePromise:
    """A prefill server's promise, as a decode server reads it."""

    tokens: int
    identity: str


def wants_remote_decode(request: Any) -> bool:
    """Whether the proxy asked this (prefill) request to leave its KV for a decode server."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def promise_for(tokens: int, identity: str) -> dict[str, Any]:
    """The params a prefill server's response carries."""
    return {PARAMS_KEY: {"version": VERSION, "tokens": tokens, "identity": identity}}


def promise_of(request: Any) -> RemotePromise | None:
    """The promise a decode request carries, or None (absent, another version, malformed:
    the request is looked up as any other)."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(ours, dict) or ours.get("version") != VERSION:
        return None
    tokens, identity = ours.get("tokens"), ours.get("identity")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0 or \
            not isinstance(identity, str):
        return None
    return RemotePromise(tokens, identity)
