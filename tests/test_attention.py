"""The batched paged attention against a per-request reference written out by hand (softmax over scores)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coral.engine.attention import AttentionBatch


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
              window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """One request: q (n, H, D) at positions start.., keys/values (start+n, Hkv, D)."""
    n, heads, _ = q.shape
    groups = heads // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    v = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    pos = torch.arange(start, start + n).view(n, 1)
    key_pos = torch.arange(len(keys)).view(1, -1)
    seen = key_pos <= pos
    if window is not None:
        seen &= key_pos > pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(heads, 1, 1).expand(heads, n, 1)], dim=-1)
    weights = scores.softmax(-1)[..., : len(keys)]
    return torch.einsum("hnl,lhd->nhd", weights, v)


def run_case(starts: list[int], counts: list[int], heads: int, kv_heads: int, window: int | None,
             with_sinks: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    dim, pool_slots = 8, sum(s + n for s, n in zip(starts, counts, strict=True)) + 5
    k_cache = torch.randn(pool_slots, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(pool_slots, kv_heads, dim, generator=gen, dtype=torch.float64)
    perm = torch.randperm(pool_slots, generator=gen)  # scattered slots, as a paged pool gives
    slots, used = [], 0
    for s, n in zip(starts, counts, strict=True):
        slots.append(perm[used:used + s + n])
        used += s + n
    q = torch.randn(sum(counts), heads, dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64) if with_sinks else None
    batch = AttentionBatch.build(starts, counts, slots, torch.device("cpu"))
    got = batch.attend(q, k_cache, v_cache, 0.3, window=window, sinks=sinks)
    at = 0
    for s, n, sl in zip(starts, counts, slots, strict=True):
        want = reference(q[at:at + n], k_cache[sl], v_cache[sl], s, 0.3, window, sinks)
        torch.testing.assert_close(got[at:at + n], want)
        at += n


def test_mixed_decode_and_prefill_steps_match_the_reference() -> None:
    """Decode steps of different lengths, a first prefill chunk and a later one, grouped-query heads."""
    run_case([7, 0, 30, 12, 0], [1, 9, 1, 5, 1], heads=4, kv_heads=2, window=None, with_sinks=False, seed=0)


def test_sliding_window_and_sinks_match_the_reference() -> None:
    run_case([40, 0, 3, 20], [1, 12, 6, 1], heads=4, kv_heads=1, window=8, with_sinks=True, seed=1)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 24), st.integers(1, 7)), min_size=1, max_size=6),
       window=st.one_of(st.none(), st.integers(1, 10)), sinks=st.booleans(), seed=st.integers(0, 10**6))
def test_any_micro_batch_matches_the_reference(steps: list[tuple[int, int]], window: int | None, sinks: bool,
                                               seed: int) -> None:
    run_case([s for s, _ in steps], [n for _, n in steps], heads=4, kv_heads=2, window=window,
             with_sinks=sinks, seed=seed)


def test_groups_cut_into_calls_within_the_gather_budget_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of a few keys' bytes: every group runs as several SDPA calls (as on a CPU with long contexts)."""
    from coral.engine import attention

    monkeypatch.setitem(attention.GATHER_BYTES, "cpu", 2 * 40 * 2 * 8 * 8)  # about two requests of 40 keys
    run_case([33, 35, 30, 0, 2, 31], [1, 1, 1, 6, 5, 1], heads=4, kv_heads=2, window=None, with_sinks=True, seed=3)
    run_case([33, 35, 30, 0, 2, 31], [1, 1, 1, 6, 5, 1], heads=4, kv_heads=2, window=4, with_sinks=False, seed=4)


def test_slot_lists_that_do_not_cover_the_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="3 slots for 2 \\+ 2 tokens"):
        AttentionBatch.build([2], [2], [torch.arange(3)], torch.device("cpu"))
