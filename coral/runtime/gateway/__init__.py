"""OpenAI-compatible gateway: routes by model across plan instances, prefill then decode (vLLM's PD protocol).

Request path: admission (at most `max_concurrency` requests upstream, at most `max_waiting` queued, each at most
half its first-byte budget (`admission_wait_s`); beyond that 429 with Retry-After; 503 when the model has no
routable instance, a planned model whose instances are not ready yet among them: never 404) -> for a model with
prefill and decode instances, a non-streaming `max_tokens: 1` request with
`kv_transfer_params: {do_remote_decode: true}` to a prefill instance, then the client's request plus the returned
`kv_transfer_params` to a decode instance (models with a single pool are sent there directly, and a PD model whose
decode pool has no routable instance, or whose decode instances all failed the request (down, not busy), is
answered by its prefill pool alone). Shedding (`GatewayConfig.shed`: while the plan in force serves only a share of
some model's demand or a model lost instances, `shed_capacity`; or always): before admission, each model is admitted up to its capacity (the
planned tokens/s of its routable instances per phase, token buckets of `coral.allocation.shedding.Shedder`: its
prompt, estimated as for request classes, and its max_tokens x n, else the model's mean output) and a request
beyond it gets 429 `model_over_capacity` with Retry-After at once, not a place in the queue (metric outcome
`shed`). Every pick of a request (prefill, decode, retries) routes by its length class:
the plan's class of its prompt length, estimated without tokenizing (`prompt_tokens`; see `registry`). A failure
before the first byte of the answer (connect error, 5xx, dropped connection) is retried on another instance of the
pool; once streaming started, an error ends the stream with an SSE error event. An engine's backpressure (429 or
503 with Retry-After) is no failure: another instance of the pool is tried, and when none has room the client gets
that status and Retry-After at once (an engine's 504 with Retry-After, its deadline passed, at once); an engine's
503 `engine_unavailable` (a node died) is a failure, and the instance is out of routing until a probe passes. A
client that disconnects before its answer cancels its upstream calls (`coral.http_serving.unless_disconnected`).
In-flight counts are released in `finally` blocks that also run on client cancels, and endpoints are released on
the object they were picked on, so churn cannot skew them. When the server's shutdown grace is over (or at a second
signal: `coral.http_serving.closing_event`), `Gateway.shut` answers the requests still waiting 503
`server_shutdown` and ends each open stream with an SSE error event of that code and `data: [DONE]`.

Access: with API keys configured (or read-only tokens), every path but `/health` and `/ready` needs `Authorization: Bearer KEY`
(`AccessGuard`; the scheme in any case; keys and tokens are kept only as SHA-256 digests): API keys reach
everything, read-only tokens GET the dashboard, metrics and state, the admin token `/replan` and those views. Each
key (or client address without keys) has a token bucket of `rate_limit_rps` answering 429 with Retry-After; bodies
over `max_body_bytes` get 413 however they are framed, bodies not received within `body_timeout_s` 408. Requests
are validated by pydantic models of OpenAI's request schema (`coral.openai_shapes`: 400 naming the field), a prompt
certainly longer than its model's context with max_tokens (`GatewayConfig.context_of`: the catalog's
`max_position_embeddings`, else `max_prompt_tokens`) is refused before routing with 400 `context_length_exceeded`,
as is n x max_tokens over `max_output_tokens` (`too_many_tokens`), and every error has OpenAI's shape `{"error":
{"message", "type", "param", "code"}}`. Metric labels are the plan's model and instance ids only (every other model
name counts as `_unknown`). One request id (the client's `X-Request-Id` or a new one) goes to both the prefill and
the decode instance, as vLLM's PD proxy does. Answers name the instance that made them (`x-coral-instance`) only
with `GatewayConfig.instance_header`, or for a request bearing the admin token in `X-Coral-Admin-Token`. A request
carrying both Content-Length and Transfer-Encoding gets 400 `ambiguous_framing` before anything else
(`FramingGuard`), and its connection is closed.

Timeouts per phase, from the model's SLOs (`Budget`; `coral serve` sets k x the TTFT and TPOT SLOs), less the time
the request waited for admission: the prefill call must answer within the prefill budget; an answer's first byte
must come within it too (streamed), each later chunk within the token budget, and the whole answer within the
prefill budget plus max_tokens token budgets (a non-streamed answer, which comes at the end, within that whole
bound). An instance that misses one gets 504 (an SSE error event once streaming started), the request is not
retried elsewhere, and the instance is ejected (`Endpoint.eject`: no requests for `eject_s`, doubling while it
keeps timing out, then one at a time until one completes), unless that would take more than `max_eject_fraction` of
its pool out or leave the pool without a routable instance (`Registry.eject`). Each upstream call carries its
first-byte deadline (`x-coral-deadline`, unix seconds), so an engine drops what would come too late. An instance
whose `/health` answers an error is out of routing at the next probe. Requests piling up on a slow instance are
bounded by the router (`registry`: no new request to an instance more than `Registry.max_excess` above its weighted
share of the pool's in-flight ones).

Probes: `/health` (GET or HEAD) is liveness, 200 while the gateway answers; `/ready` is readiness, 200 once every
planned model (`Registry.planned_models`: the plan in force's, before one the scenario's) has a routable instance,
else 503 with Retry-After naming the models not ready yet.
"""

from __future__ import annotations

from coral.runtime.gateway.access import AccessGuard, FramingGuard, RateLimiter
from coral.runtime.gateway.app import create_gateway_app
from coral.runtime.gateway.config import (
    CHARS_PER_TOKEN,
    MAX_CHARS_PER_TOKEN,
    Budget,
    GatewayConfig,
    answer_budget,
    key_digest,
    load_secrets,
    prompt_tokens,
)
from coral.runtime.gateway.errors import BodyRefused, UpstreamError, error_response, parse_json, read_body
from coral.runtime.gateway.stats import TokenClock
from coral.runtime.gateway.upstream import Gateway

__all__ = [
    "CHARS_PER_TOKEN",
    "MAX_CHARS_PER_TOKEN",
    "AccessGuard",
    "BodyRefused",
    "Budget",
    "FramingGuard",
    "Gateway",
    "GatewayConfig",
    "RateLimiter",
    "TokenClock",
    "UpstreamError",
    "answer_budget",
    "create_gateway_app",
    "error_response",
    "key_digest",
    "load_secrets",
    "parse_json",
    "prompt_tokens",
    "read_body",
]
