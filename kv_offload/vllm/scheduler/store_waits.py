"""Lookups that wait, briefly and boundedly, for blocks another engine stored.

The scheduler side knows what the ranks reported; the ranks know what their storage tier's
view holds; the view learns what other engines store from its background refresh, which
may lag by seconds, and an engine that does not step sends no report at all. Two kinds of
request therefore wait before their lookup is answered (vLLM asks again at every step
while the connector answers None; the request stays WAITING, holds no engine blocks, and
every other request keeps running):

- **remote** (prefill/decode disaggregation): a request whose `kv_transfer_params` carry a
  prefill server's promise (`kv_offload.vllm.pd_params`): it waits until the promised
  blocks are known on every rank, or `remote_wait_s` passes (then it loads what is there
  and recomputes the rest: a missed deadline, counted).
- **find** (`find_on_lookup`, on an engine with a storage tier): the first lookup of a
  request waits at most `FIND_WAIT_S` for the ranks' answer. `"when_idle"` (the default):
  only on an engine that ran no forward for `IDLE_S`, whose reports are as old as its last
  step (without it an engine idle for minutes would miss what others stored meanwhile); a
  busy engine's reports are fresh and what others store reaches it with its tier's refresh
  (0.5 s on Valkey, `rescan_interval_s`, 5 s, on a directory). `"always"`: busy engines
  too, so what others stored is found within one answer (a step or two) whatever the
  tier's refresh, at the price of a step or two more before a prompt nobody stored is
  computed. `"never"`: no find waits.

While a request waits, the keys it lacks go out in the step's metadata (`find`, at most
`FIND_KEYS` per request): each rank asks its storage tier itself
(`kv_offload.vllm.worker.finder`), so the cost is proportional to the request, never to the
store. A remote wait asks again every `FIND_INTERVAL_S` (the prefill server may still be
writing); a find wait asks first for the first missing block of each group (a prompt
nobody stored, the usual case, costs one question per group) and, only if that was there,
for the rest, and ends once every rank has answered (each report says which step's
questions it answered: `RankReport.found_through`). A busy engine's first lookups neither
wait nor ask: its reports are fresh, and keys others store reach it through the tiers'
refresh (`docs/tiers.md`).

Own state: the waits in progress, by request, and counters the connector turns into
metrics (`take_counts`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

IDLE_S = 0.5  # no forward for this long: reports may be stale, a first lookup asks first
FIND_WAIT_S = 0.5  # the longest an idle engine's first lookup waits for the ranks' answer
FIND_INTERVAL_S = 0.1  # a waiting request's missing keys are asked for again this often
FIND_KEYS = 256  # keys asked per request and round (its first missing blocks, in order)

REMOTE, FIND = "remote", "find"


@dataclass
class Wait:
    """One request's wait: until its hit reaches `tokens` or `until` passes."""

    kind: str  # REMOTE or FIND
    tokens: int
    started: float
    until: float
    next_find: float
    find_step: int | None = None  # the plan step its last `find` went out with
    rounds: int = 0  # `find`s sent
    hit_at_find: int = 0  # (find: the hit when its first question went out)


class StoreWaits:
    """The waits in progress (see the module docstring)."""

    def __init__(self, remote_wait_s: float, *, storage: bool,
                 find_on_lookup: str = "when_idle") -> None:
        self.remote_wait_s = remote_wait_s
        self.storage = storage  # (no storage tier: nothing another engine stores is ours)
        self.find_on_lookup = find_on_lookup  # "when_idle", "always" or "never"
        self._waits: dict[str, Wait] = {}
        self._last_forward = time.monotonic()
        self._counts: Counter[str] = Counter()

    def forward_planned(self) -> None:
        """A step with a forward was planned (the engine is busy)."""
        self._last_forward = time.monotonic()

    def begin(self, request_id: str, kind: str, tokens: int) -> Wait | None:
        """Start waiting for `tokens` (once per request); None where this kind does not
        wait here (an engine that was busy; no storage tier for a find)."""
        now = time.monotonic()
        if kind == FIND and (not self.storage or self.find_on_lookup == "never" or (
                self.find_on_lookup == "when_idle" and now - self._last_forward < IDLE_S)):
            return None
        limit = self.remote_wait_s if kind == REMOTE else FIND_WAIT_S
        wait = self._waits[request_id] = Wait(kind, tokens, now, now + limit, now)
        self._counts[f"{kind}_waits"] += 1
        return wait

    def get(self, request_id: str) -> Wait | None:
        return self._waits.get(request_id)

    def over(self, request_id: str, hit_tokens: int) -> bool:
        """Whether the request's wait is over with a hit of `hit_tokens`: it reached what
        it waits for, or its deadline passed (the caller ends it)."""
        wait = self._waits.get(request_id)
        return wait is None or hit_tokens >= wait.tokens or time.monotonic() >= wait.until

    def count(self, name: str, amount: float = 1) -> None:
        """Add to a counter of `take_counts` (the connector's metrics)."""
        self._counts[name] += amount

    def due_to_find(self, request_id: str) -> bool:
        """Whether the request's missing keys should be asked for now (and when next)."""
        wait = self._waits.get(request_id)
        now = time.monotonic()
        if wait is None or now < wait.next_find:
            return False
        wait.next_find = now + FIND_INTERVAL_S
        return True

    def end(self, request_id: str, *, missed: bool = False) -> None:
        wait = self._waits.pop(request_id, None)
        if wait is None:
            return
        self._counts[f"{wait.kind}_wait_seconds"] += time.monotonic() - wait.started
        if missed:
            self._counts[f"{wait.kind}_deadlines_missed"] += 1

    def take_counts(self) -> dict[str, float]:
        counts, self._counts = dict(self._counts), Counter()
        return counts
