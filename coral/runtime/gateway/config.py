"""Gateway configuration, prompt-length estimates and the time budgets of upstream calls."""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

from coral.catalog.loader import CoralInputError, builtin_catalog, read_input_text

CHARS_PER_TOKEN = 4.0
"""Characters per token of text prompts: an estimate (the gateway does not tokenize) for request classes."""
MAX_CHARS_PER_TOKEN = 16.0
"""Characters per token no tokenizer exceeds on ordinary text: prompts refused as longer than the context are
longer at this rate (a lower bound on their tokens), so no prompt that fits is refused."""

log = logging.getLogger("coral.secrets")


def prompt_tokens(body: dict[str, Any], chars_per_token: float = CHARS_PER_TOKEN) -> float:
    """Estimated prompt tokens of a validated request: token ids are counted (the longest of several
    prompts), text is `chars_per_token` characters a token (chat: all text contents together)."""
    if "messages" in body:
        chars = 0
        for m in body["messages"]:
            c = m.get("content")
            parts = [c] if isinstance(c, str) else [p.get("text") for p in c or [] if isinstance(p, dict)]
            chars += sum(len(t) for t in parts if isinstance(t, str))
        return chars / chars_per_token
    p = body["prompt"]
    if isinstance(p, str):
        return len(p) / chars_per_token
    if isinstance(p[0], int):
        return float(len(p))
    return max(len(x) if isinstance(x, list) else len(x) / chars_per_token for x in p)


ShedMode = Literal["plan", "always", "off"]
"""When the gateway sheds (`GatewayConfig.shed`)."""


def output_tokens(body: dict[str, Any]) -> float | None:
    """Output tokens a validated request asks for: max_tokens (or max_completion_tokens) x n; None when unset."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return float(max_tokens * (body.get("n") or 1)) if max_tokens else None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_secrets(env_var: str, path: Path | None = None) -> list[str]:
    """Secrets from `path` (one a line, `#` comments; read as every input file is, `read_input_text`; a file
    others than its owner may read or write is read with a warning) and the comma-separated env var `env_var`.
    Error messages name the file or variable, never a secret."""
    found = [k.strip() for k in os.environ.get(env_var, "").split(",") if k.strip()]
    if path is not None:
        lines = read_input_text(path).splitlines()
        mode = Path(path).stat().st_mode
        if mode & 0o077:
            log.warning("%s: readable or writable by others than its owner (mode %s): secrets belong in a file only "
                        "its owner reads; chmod 600 %s", path, oct(mode & 0o777), path)
        found += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    for k in found:
        if len(k) < 8 or any(c.isspace() for c in k):
            raise CoralInputError(
                f"{path or env_var}: each secret must be at least 8 characters without spaces"
            )
    return found


OPEN_PATHS = frozenset({"/health", "/ready"})
"""Answered without credentials (load-balancer and orchestrator probes)."""
READ_PATHS = frozenset({"/metrics", "/gateway/state", "/state", "/dashboard", "/dashboard/state.json"})
ADMIN_PATHS = frozenset({"/replan"})
ADMIN_TOKEN_HEADER = "x-coral-admin-token"
"""A request bearing the admin token in this header gets its answer's instance id (`x-coral-instance`) even
without `GatewayConfig.instance_header`."""
TOKEN_COOKIE = "coral_token"
"""Browsers open `/dashboard?token=TOKEN` once; the page's polls then send the token as this cookie (HttpOnly,
SameSite=Strict, Path=/dashboard)."""
UNKNOWN_MODEL = "_unknown"
"""The one metric label of every model not in the plan (label values come only from the plan)."""


@cache
def catalog_contexts() -> dict[str, int]:
    """Context length (`max_position_embeddings`) of each model of the built-in catalog that states one."""
    models = builtin_catalog().models.values()
    return {m.name: m.max_position_embeddings for m in models if m.max_position_embeddings is not None}


@dataclass(frozen=True)
class GatewayConfig:
    max_concurrency: int = 256
    max_waiting: int = 1024
    queue_timeout_s: float = 30.0
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    """For models without SLO timeouts (`prefill_timeout_s`, `token_timeout_s`): how long an instance may go
    without sending a byte of its answer."""
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2
    retry_after_s: int = 1
    api_key_digests: frozenset[str] = field(default=frozenset(), repr=False)
    """SHA-256 digests of the accepted API keys (`with_api_keys`); empty = no authentication."""
    rate_limit_rps: float = 0.0
    """Requests/s allowed per key (per client address without keys); 0 = unlimited."""
    rate_limit_burst: int = 0
    """Bucket size (default: max(1, rate_limit_rps))."""
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    """A request body not received in full within this gets 408 (slow clients cannot hold a slot)."""
    upstream_api_key: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer` to the engines (vLLM `--api-key`)."""
    prefill_timeout_s: dict[str, float] = field(default_factory=dict)
    """Per model, how long an instance may take to answer the prefill call or send an answer's first byte (from
    the model's TTFT SLO, `coral serve`); models not listed wait `request_timeout_s`."""
    token_timeout_s: dict[str, float] = field(default_factory=dict)
    """Per model, how long a streamed answer may go without a chunk after its first, and per max_tokens token
    in the bound of the whole answer (from the model's TPOT SLO, `coral serve`); models not listed wait
    `request_timeout_s` for each chunk and have no bound for the whole answer."""
    max_prompt_tokens: int = 131_072
    """Context length of models without one in `context_tokens`: prompts certainly longer (token ids, or text at
    `MAX_CHARS_PER_TOKEN`), with max_tokens, get 400 before routing, so no instance is stalled by one."""
    context_tokens: dict[str, int] | None = None
    """Context length per model (prompt + max_tokens); None: the built-in catalog's `max_position_embeddings`
    (`catalog_contexts`). Models not listed have `max_prompt_tokens`."""
    max_output_tokens: int = 65_536
    """Tokens one request may ask to generate over all its choices (n x max_tokens); more get 400."""
    max_eject_fraction: float = 0.5
    """At most this share of a pool's (model, phase) instances are ejected at once, and never its last routable
    one (Envoy's max ejection percent): an instance past the cap keeps serving."""
    eject_s: float = 30.0
    """An instance on which a request timed out gets no requests for this long, doubling while it keeps timing
    out (outlier ejection; the timed-out request is not sent to another instance)."""
    read_token_digests: frozenset[str] = field(default=frozenset(), repr=False)
    """Digests of read-only tokens: GET on `READ_PATHS` (dashboard, metrics, state) and nothing else."""
    admin_token_digests: frozenset[str] = field(default=frozenset(), repr=False)
    """Digests of admin tokens: `ADMIN_PATHS` (`/replan`) and `READ_PATHS`."""
    instance_header: bool = False
    """Whether every answer names the instance that made it (`x-coral-instance`: plan ids, internal); off, only
    requests bearing an admin token in `ADMIN_TOKEN_HEADER` see it."""
    shed: ShedMode = "plan"
    """When each model is admitted only up to its capacity, the excess refused at once with 429
    `model_over_capacity` (`coral.allocation.shedding`): "plan" while the plan in force serves only a share of some
    model's demand or a model lost instances (`shed_capacity`, from the plan the controller set), "always", or
    "off"."""

    def context_of(self, model: str) -> int:
        """The context length of `model` in tokens (prompt + output)."""
        contexts = catalog_contexts() if self.context_tokens is None else self.context_tokens
        return contexts.get(model, self.max_prompt_tokens)

    def with_api_keys(self, keys: Iterable[str]) -> GatewayConfig:
        return replace(self, api_key_digests=frozenset(key_digest(k) for k in keys))

    def with_tokens(self, read: Iterable[str] = (), admin: Iterable[str] = ()) -> GatewayConfig:
        return replace(
            self,
            read_token_digests=frozenset(key_digest(k) for k in read),
            admin_token_digests=frozenset(key_digest(k) for k in admin),
        )

    @property
    def guarded(self) -> bool:
        """Whether credentials are required (API keys or read tokens configured): then every path but
        `OPEN_PATHS` needs one."""
        return bool(self.api_key_digests or self.read_token_digests)

    def allows(self, digest: str, method: str, path: str) -> bool:
        """Whether the credential of SHA-256 `digest` may call `method path`."""
        if digest in self.api_key_digests:
            return True
        read = method in ("GET", "HEAD") and path in READ_PATHS
        if digest in self.admin_token_digests:
            return read or path in ADMIN_PATHS
        return read and digest in self.read_token_digests


@dataclass(frozen=True)
class Budget:
    """How long an instance may take over one upstream call: until the first byte of the answer, between later
    chunks, and for the whole answer (seconds; `math.inf`: no bound)."""

    first_s: float
    gap_s: float
    total_s: float = math.inf

    def deadline(self, now: float) -> float | None:
        """When the answer's first byte is due, for a call sent at `now` (unix seconds); None: no bound."""
        first = min(self.first_s, self.total_s)
        return now + first if math.isfinite(first) else None

    @property
    def first_wait_s(self) -> float:
        """How long the gateway waits for the first byte: past the deadline the engine has, by a tenth (at most
        1 s), so an engine dropping a request still waiting at its deadline says so first (a refusal, not a
        timeout that ejects it)."""
        first = min(self.first_s, self.total_s)
        return first + min(1.0, first / 10)


def answer_budget(
    config: GatewayConfig, model: str, body: dict[str, Any], prefill_only: bool, waited_s: float = 0.0
) -> Budget:
    """The `Budget` of a validated request `body` of `model` that waited `waited_s` in the gateway's admission
    queue (taken off its first-byte and whole-answer bounds): the prefill call (`prefill_only`) within the
    prefill timeout; an answer's first byte within it too when streamed, later chunks each within the token
    timeout, the whole answer within the prefill timeout plus a token timeout per token of max_tokens (of the
    context when unset); a non-streamed answer, which comes at the end, within that whole bound."""
    ttft = (config.prefill_timeout_s.get(model) or config.request_timeout_s) - waited_s
    if prefill_only:
        return Budget(ttft, ttft, ttft)
    per_token = config.token_timeout_s.get(model)
    if per_token is None:
        whole = config.request_timeout_s - waited_s
        return Budget(ttft if body.get("stream") else whole, config.request_timeout_s)
    n = body.get("max_completion_tokens") or body.get("max_tokens") or config.context_of(model)
    total = ttft + n * per_token
    return Budget(ttft if body.get("stream") else total, per_token, total)


def admission_wait_s(config: GatewayConfig, model: str) -> float:
    """How long a request of `model` may wait for admission: `queue_timeout_s`, and at most half its first-byte
    budget, so the instance it goes to has at least the other half (a request that waited longer could not
    make its deadline: 429 at once instead of a timeout that ejects an instance)."""
    return min(config.queue_timeout_s, (config.prefill_timeout_s.get(model) or config.request_timeout_s) / 2)



