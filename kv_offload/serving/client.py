"""The client side of a vLLM OpenAI-compatible server: completions, cache reset, metrics.

Completions go through the official `openai` client (what users run); the endpoints outside
the OpenAI API — `/health`, `/tokenize`, `/metrics` and the development endpoint
`/reset_prefix_cache` (only with `VLLM_SERVER_DEV_MODE=1`) — through httpx, which the openai
client is built on.

Every request asks for greedy decoding with the top logprobs of each generated token, and for
tokens as ids (`return_tokens_as_token_ids`, a vLLM extension): two servers that hold the
same KV must give the same tokens and, on one build, the same logprobs; a wrong byte of KV
shows up in the logprobs long before it flips a greedy token. `Completion` keeps exactly
that, plus `usage.prompt_tokens_details.cached_tokens` (needs the server flag
`--enable-prompt-tokens-details`), which counts the prompt tokens vLLM did not compute:
hits in its own prefix cache plus those a KV connector loaded.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from kv_offload.errors import ServingError
from kv_offload.serving.metrics import ServerMetrics, parse_metrics

_EXTRA_BODY = {"return_tokens_as_token_ids": True}


@dataclass(frozen=True)
class Completion:
    """One greedy completion as a client saw it."""

    prompt_tokens: int
    cached_tokens: int | None
    """Prompt tokens served from a cache; None when the server does not report them."""
    tokens: tuple[str, ...]
    """Generated tokens, as vLLM names them with return_tokens_as_token_ids ("token_id:N")."""
    top_logprobs: tuple[dict[str, float], ...]
    """Per generated token: candidate token -> logprob."""
    seconds: float
    """Wall time of the request."""
    first_token_s: float | None = None
    """Time to the first generated token (streamed requests only)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Completion:
        return cls(
            prompt_tokens=data["prompt_tokens"],
            cached_tokens=data["cached_tokens"],
            tokens=tuple(data["tokens"]),
            top_logprobs=tuple(data["top_logprobs"]),
            seconds=data["seconds"],
            first_token_s=data.get("first_token_s"),
        )


@dataclass(frozen=True)
class OutputComparison:
    """How a completion differs from a reference completion of the same request."""

    same_tokens: bool
    first_difference: int | None
    """Index of the first generated token that differs (None when all agree)."""
    max_logprob_diff: float
    """Largest |difference| over the candidates both list, position by position, up to and
    including the first different token (later positions continue different texts)."""
    same_candidates: bool
    """Whether every position lists the same candidate tokens."""

    def identical(self, tolerance: float = 0.0) -> bool:
        """Same tokens and logprobs within `tolerance` (0: bit-identical, same candidates)."""
        if not self.same_tokens or self.max_logprob_diff > tolerance:
            return False
        return self.same_candidates or tolerance > 0


def compare_outputs(reference: Completion, other: Completion) -> OutputComparison:
    """Compare `other` to `reference` token by token and logprob by logprob."""
    first = next((i for i, (a, b) in enumerate(zip(reference.tokens, other.tokens)) if a != b),
                 None)
    if first is None and len(reference.tokens) != len(other.tokens):
        first = min(len(reference.tokens), len(other.tokens))
    # Positions after the first different token continue different texts: not comparable.
    steps = list(zip(reference.top_logprobs, other.top_logprobs))
    if first is not None:
        steps = steps[: first + 1]
    worst = 0.0
    same_candidates = True
    for ref_step, step in steps:
        same_candidates = same_candidates and ref_step.keys() == step.keys()
        shared = ref_step.keys() & step.keys()
        if not shared and (ref_step or step):
            worst = math.inf  # nothing in common to compare: as different as it gets
        for token in shared:
            worst = max(worst, abs(ref_step[token] - step[token]))
    return OutputComparison(first is None, first, worst, same_candidates)


class ResetResult(enum.Enum):
    """What `POST /reset_prefix_cache` did."""

    RESET = "reset"
    BUSY = "busy"  # vLLM refused: blocks still held by running requests or transfers
    UNAVAILABLE = "unavailable"  # no such endpoint: the server runs without VLLM_SERVER_DEV_MODE=1


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int]
    max_model_len: int | None


def api_roots(url: str) -> tuple[str, str]:
    """(server root, OpenAI API root) from `http://host:port` or `http://host:port/v1`."""
    root = url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    if not root.startswith(("http://", "https://")):
        raise ServingError(f"server URL {url!r} must start with http:// or https://")
    return root, root + "/v1"


class ServingClient:
    """A blocking client of one vLLM OpenAI-compatible server."""

    def __init__(self, url: str, *, api_key: str = "EMPTY", timeout_s: float = 120.0,
                 model: str | None = None) -> None:
        import httpx
        import openai

        self.root, self.api_root = api_roots(url)
        headers = {"Authorization": f"Bearer {api_key}"}
        self._http = httpx.Client(base_url=self.root, timeout=timeout_s, headers=headers)
        # No retries: a check must see the first failure, not a retried success.
        self._openai = openai.OpenAI(base_url=self.api_root, api_key=api_key,
                                     timeout=timeout_s, max_retries=0)
        self._model = model

    def close(self) -> None:
        self._http.close()
        self._openai.close()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> bool:
        """True when `GET /health` answers 200."""
        import httpx

        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def model(self) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self._model is None:
            models = self._openai.models.list().data
            if not models:
                raise ServingError(f"{self.api_root}/models lists no model")
            self._model = models[0].id
        return self._model

    def tokenize(self, text: str) -> TokenizeResult:
        """Token ids of `text` by the server's own tokenizer (`POST /tokenize`)."""
        response = self._http.post("/tokenize", json={"model": self.model, "prompt": text})
        if response.status_code != 200:
            raise ServingError(f"POST {self.root}/tokenize answered {response.status_code}: "
                               f"{response.text[:200]}")
        body = response.json()
        return TokenizeResult(list(body["tokens"]), body.get("max_model_len"))

    def complete(self, prompt: list[int] | str, *, max_tokens: int,
                 logprobs: int) -> Completion:
        """One greedy completion with the top `logprobs` candidates per generated token."""
        started = time.perf_counter()
        response = self._openai.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            logprobs=logprobs, extra_body=_EXTRA_BODY,
        )
        seconds = time.perf_counter() - started
        choice = response.choices[0]
        if choice.logprobs is None or choice.logprobs.tokens is None:
            raise ServingError("the completion carries no logprobs although logprobs="
                               f"{logprobs} was asked for")
        return Completion(
            prompt_tokens=response.usage.prompt_tokens,
            cached_tokens=_cached_tokens(response.usage),
            tokens=tuple(choice.logprobs.tokens),
            top_logprobs=tuple(dict(step or {}) for step in choice.logprobs.top_logprobs or []),
            seconds=seconds,
        )

    def reset_prefix_cache(self, *, running_requests: bool = False) -> ResetResult:
        """Drop vLLM's own prefix cache (not the connector's).

        `running_requests=True` preempts running requests first (they are recomputed), so
        the reset also succeeds under load.
        """
        params = {"reset_running_requests": "true"} if running_requests else {}
        response = self._http.post("/reset_prefix_cache", params=params)
        if response.status_code in (404, 405):
            return ResetResult.UNAVAILABLE
        if response.status_code != 200:
            raise ServingError(f"POST {self.root}/reset_prefix_cache answered "
                               f"{response.status_code}: {response.text[:200]}")
        return ResetResult.RESET if response.json().get("success") else ResetResult.BUSY

    def metrics_text(self) -> str:
        response = self._http.get("/metrics")
        if response.status_code != 200:
            raise ServingError(f"GET {self.root}/metrics answered {response.status_code}")
        return response.text

    def metrics(self) -> ServerMetrics:
        return parse_metrics(self.metrics_text())


async def stream_completion(client: Any, model: str, prompt: list[int] | str, *,
                            max_tokens: int, logprobs: int) -> Completion:
    """One greedy completion streamed through an `openai.AsyncOpenAI` client, with its TTFT.

    The time to first token is taken at the first chunk that carries generated text.
    """
    started = time.perf_counter()
    first_token_s: float | None = None
    tokens: list[str] = []
    top: list[dict[str, float]] = []
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
        stream=True, stream_options={"include_usage": True}, extra_body=_EXTRA_BODY,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.logprobs is None or not choice.logprobs.tokens:
                continue
            if first_token_s is None:
                first_token_s = time.perf_counter() - started
            tokens.extend(choice.logprobs.tokens)
            top.extend(dict(step or {}) for step in choice.logprobs.top_logprobs or [])
    if usage is None:
        raise ServingError("the stream ended without a usage chunk (stream_options "
                           "include_usage was asked for)")
    return Completion(
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=_cached_tokens(usage),
        tokens=tuple(tokens),
        top_logprobs=tuple(top),
        seconds=time.perf_counter() - started,
        first_token_s=first_token_s,
    )


def _cached_tokens(usage: Any) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None)
    return None if details is None else details.cached_tokens
