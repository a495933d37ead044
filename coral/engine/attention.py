"""Attention of a whole micro-batch over the paged KV pool in a few `scaled_dot_product_attention` calls (one per
group of requests of similar shape), instead of one call per request.

A micro-batch mixes requests of different lengths: each brings `count` new tokens (its queries) after `start`
tokens already in the pool. The requests of a group are padded to the group's longest query run and longest key
run: keys are gathered from the pool through a (requests, keys) slot matrix (padding points at slot 0 and is
masked), and a boolean mask lets query i of a request see the request's keys at positions ≤ start + i (and, for
a sliding-window layer, > start + i − window). Decode steps (one query each) and prefill chunks are grouped
apart, so a long chunk never pads every decode step to its length; within each kind, requests sorted by length
are cut into groups whose padding stays under `max_padding` of their keys (gathering keys is what costs on a
CPU: a group padded to twice its keys copies twice the memory), so a batch of similar lengths is one call. On a
CPU a group's gathered keys and values are also kept within `GATHER_BYTES` per call (a few MiB, so they are read
back from cache: one 130 MiB gather for 128 requests ran 2.5x slower than 128 small ones, chunks of 4-16 MiB at
par, `benchmarks/attention.py`); on a GPU a group is one call, however large.

Extras some architectures need: grouped-query attention (key/value heads shared by several query heads), a
per-layer sliding window, and per-head attention sinks (gpt-oss): a sink adds exp(sink) to a head's softmax
denominator without a value, computed exactly as one extra all-zero key whose additive bias is the sink logit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention

#: bytes of gathered keys + values per SDPA call, per device type (absent: no bound)
GATHER_BYTES = {"cpu": 8 << 20}


@dataclass
class _Group:
    """Requests of one kind, padded: `rows` (B, N) are indices into the flattened queries (padding: row 0,
    dropped by `valid`), `keys` (B, L) pool slots (padding: slot 0), `positions` (B, N) each query's position,
    `lengths` (B,) each request's key count."""

    rows: torch.Tensor
    valid: torch.Tensor
    keys: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> (B, 1, N, L) bool

    def mask(self, window: int | None) -> torch.Tensor:
        """Which keys each query sees (causal, within the request, inside the window if any); cached per
        window, since a micro-batch runs every layer with the same requests."""
        if window not in self.masks:
            key_pos = torch.arange(self.keys.shape[1], device=self.keys.device)
            pos = self.positions.unsqueeze(-1)
            seen = key_pos <= pos
            if window is not None:
                seen &= key_pos > pos - window
            seen &= self.valid.unsqueeze(-1)
            seen[..., 0] |= ~self.valid  # padded query rows see one key, so their (dropped) softmax is finite
            self.masks[window] = seen.unsqueeze(1)
        return self.masks[window]


def _similar(members: list[int], starts: Sequence[int], counts: Sequence[int], max_padding: float
             ) -> list[list[int]]:
    """`members` cut into runs of similar key counts (longest first)."""
    runs: list[list[int]] = []
    for i in sorted(members, key=lambda i: -(starts[i] + counts[i])):
        if runs and (starts[runs[-1][0]] + counts[runs[-1][0]]) <= (1 + max_padding) * (starts[i] + counts[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class AttentionBatch:
    """The attention geometry of one micro-batch, built once and used by every layer of the shard."""

    def __init__(self, tokens: int, groups: list[_Group]) -> None:
        self.tokens, self.groups = tokens, groups

    @classmethod
    def build(cls, starts: Sequence[int], counts: Sequence[int], slots: Sequence[torch.Tensor],
              device: torch.device, max_padding: float = 0.25) -> AttentionBatch:
        """`starts[i]`: tokens of request i in the pool before this step; `counts[i]`: its new tokens, whose
        queries come in request order in the flattened batch; `slots[i]`: pool slots of its tokens
        [0, starts[i] + counts[i]); `max_padding`: a group's longest request has at most 1 + this times the
        keys of its shortest."""
        if not len(starts) == len(counts) == len(slots):
            raise ValueError(f"{len(starts)} starts, {len(counts)} counts and {len(slots)} slot lists")
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        groups = []
        for members in _similar([i for i, n in enumerate(counts) if n == 1], starts, counts, max_padding) + \
                _similar([i for i, n in enumerate(counts) if n > 1], starts, counts, max_padding):
            width = max(counts[i] for i in members)
            span = max(starts[i] + counts[i] for i in members)
            rows = torch.zeros(len(members), width, dtype=torch.long)
            valid = torch.zeros(len(members), width, dtype=torch.bool)
            positions = torch.zeros(len(members), width, dtype=torch.long)
            keys = torch.zeros(len(members), span, dtype=torch.long, device=device)
            for b, i in enumerate(members):
                n, start = counts[i], starts[i]
                if len(slots[i]) != start + n:
                    raise ValueError(f"request {i}: {len(slots[i])} slots for {start} + {n} tokens")
                rows[b, :n] = torch.arange(offsets[i], offsets[i] + n)
                valid[b, :n] = True
                positions[b, :n] = torch.arange(start, start + n)
                keys[b, :start + n] = slots[i]
            lengths = torch.tensor([starts[i] + counts[i] for i in members])
            groups.append(_Group(rows.to(device), valid.to(device), keys, positions.to(device), lengths.to(device)))
        return cls(offsets[-1], groups)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (T, heads, head_dim) of queries `q` (T, heads, head_dim) over one layer's pool
        (`k_cache`, `v_cache`: (slots, kv_heads, head_dim), this step's keys already written)."""
        if q.shape[0] != self.tokens:
            raise ValueError(f"{q.shape[0]} queries for a micro-batch of {self.tokens} tokens")
        out = torch.empty_like(q)
        heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
        budget = GATHER_BYTES.get(q.device.type)
        for g in self.groups:
            span = g.keys.shape[1]
            per_request = 2 * span * kv_heads * dim * k_cache.element_size()
            step = len(g.keys) if budget is None else max(1, budget // per_request)
            for a in range(0, len(g.keys), step):
                rows, valid, slots = g.rows[a:a + step], g.valid[a:a + step], g.keys[a:a + step]
                res = self._call(q.index_select(0, rows.flatten()).view(*rows.shape, heads, dim).transpose(1, 2),
                                 k_cache.index_select(0, slots.flatten()).view(*slots.shape, kv_heads, dim),
                                 v_cache.index_select(0, slots.flatten()).view(*slots.shape, kv_heads, dim),
                                 g.mask(window)[a:a + step], scale, sinks)
                out.index_copy_(0, rows[valid], res.transpose(1, 2)[valid])  # valid queries, in row order
        return out

    @staticmethod
    def _call(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
              sinks: torch.Tensor | None) -> torch.Tensor:
        """One SDPA call: queries (B, heads, N, dim), keys and values (B, L, kv_heads, dim), mask (B, 1, N, L)."""
        b, heads, n, dim = queries.shape
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        kv_heads, span = keys.shape[1], keys.shape[2]
        if sinks is not None:
            bias = torch.zeros(mask.shape, dtype=queries.dtype, device=queries.device).masked_fill_(~mask, float("-inf"))
            sink = sinks.to(queries.dtype).view(1, heads, 1, 1).expand(b, heads, n, 1)
            mask = torch.cat([bias.expand(b, heads, n, span), sink], dim=-1)
            zero = keys.new_zeros(b, kv_heads, 1, dim)
            keys, values = torch.cat([keys, zero], dim=2), torch.cat([values, zero], dim=2)
        return scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                            enable_gqa=heads != kv_heads)
