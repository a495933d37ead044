"""What one request pays on a pipeline besides queueing: the KV hand-off from prefill to decode, and its own
latency served alone (chunked prefill through the stages, one decode token per pipeline cycle). The planner
rates templates with these rules (`coral.allocation.latency`) and the simulator charges them
(`coral.simulation.engine`), so both price the same physics.

KV hand-off. In a disaggregated engine (vLLM's KV connectors over NIXL/UCX, Mooncake, Dynamo) every worker
holds the KV of its own layers and sends it straight to the worker(s) holding the same layers on the decode
side: pipeline stages do not forward each other's KV, and the transfers of different nodes run at once over
their own NICs. A node's NIC carries only its layers' share, so the hand-off lasts as long as the busiest NIC
needs, on either side:

    hand-off = max( max over prefill nodes of layers × KV bytes per layer / NIC,
                    max over decode nodes  of layers × KV bytes per layer / NIC )

(a bipartite transfer whose flows can share each link in any order finishes in the larger of the largest row
and column load, and no earlier). The previous rule sent every decode stage's layers over the slowest NIC of the
whole prefill pipeline, which charged a mixed pipeline for its slowest node as if that node held every layer.
The two sides are independent, so each template can be charged its own side (`handoff_side_s`); the
simulator takes the larger side of the two paths a request uses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def handoff_side_s(kv_bytes_per_layer: np.ndarray | float, node_layers: np.ndarray, nic_bytes_s: np.ndarray
                   ) -> np.ndarray:
    """Seconds one side of a hand-off needs: the largest layers / NIC over its nodes (`node_layers` and
    `nic_bytes_s` of equal shape, last axis the nodes; a node with 0 layers sends nothing) × the prompt's KV
    bytes per layer (broadcast against the leading axes)."""
    per_byte = np.where(node_layers > 0, node_layers / np.asarray(nic_bytes_s, dtype=float), 0.0).max(axis=-1)
    return np.asarray(per_byte * np.asarray(kv_bytes_per_layer, dtype=float))


def chunked_prefill_s(first_chunk_s: np.ndarray, all_chunks_s: np.ndarray) -> np.ndarray:
    """Seconds until a prompt has passed every stage when served alone: stage s takes `first_chunk_s[..., s]` for
    its first chunk and `all_chunks_s[..., s]` for all of them (last axis the stages); chunks pipeline, so the
    prompt pays each stage's first chunk and the bottleneck stage's remaining ones."""
    return np.asarray(first_chunk_s.sum(axis=-1) + (all_chunks_s - first_chunk_s).max(axis=-1))


def prefill_chunks_s(step_s: Callable[[np.ndarray], np.ndarray], cap: np.ndarray, prompt_tokens: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(first chunk, all chunks) seconds of prompts on nodes whose step takes `step_s(x)` seconds for x tokens
    and takes at most `cap` tokens a step (`cap` broadcasts against `prompt_tokens`: e.g. one per layer count in
    a column against the prompts in a row)."""
    p = np.asarray(prompt_tokens, dtype=np.int64)
    c = np.maximum(np.asarray(cap, dtype=np.int64), 1)
    full, rest = np.divmod(p, c)
    first = step_s(np.minimum(p, c).astype(float))
    whole = step_s(np.broadcast_to(c, full.shape).astype(float))
    last = step_s(np.maximum(rest, 1).astype(float))
    return first, full * whole + np.where(rest > 0, last, 0.0)
