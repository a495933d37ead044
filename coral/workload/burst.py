"""How bursty a workload is, as the capacity it needs: the percentile rule that sizes each (model, phase).

Planning for the mean token rate fills every instance to 100 % on average, so any burst queues and misses its SLO.
The capacity a phase needs for a fraction q of its requests to meet the SLO is set by the load the traffic puts
on it over windows about as long as the SLO, seen from where the tokens are:

* **prefill** (TTFT SLO ``W``): every request sees the prompt tokens that arrived in the trailing window
  ``(t - W, t]`` (its own included); they must all be prefilled within about ``W`` for it to meet its TTFT. The
  planned rate is the q-th percentile of ``tokens in window / W`` over requests weighted by their prompt tokens
  (a long prompt is as many tokens in need of capacity as many short ones).
* **decode** (TPOT SLO ``s``): a request holds a decode slot for about ``output tokens × s``; the concurrency N(t)
  of such slots is what the pool must hold. The planned rate is the mean output-token rate × the q-th percentile
  of N over generated tokens (each token sees the N of its moment: weight ``N·dt``) ÷ the time-mean of N.

Both are returned as *burst factors*: planned rate ÷ mean rate (never below 1). Hand-checkable on small traces
(tests/test_planning.py). The rule is a starting point that the simulator-in-the-loop search
(`coral.planning.slo_search`) corrects per (model, phase).
"""

from __future__ import annotations

import numpy as np

from coral.workload.traces import RequestSet


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Smallest value v such that the values <= v carry at least a fraction q of the total weight."""
    if not 0 <= q <= 1:
        raise ValueError("q must be in [0, 1]")
    keep = weights > 0
    v, w = np.asarray(values, dtype=float)[keep], np.asarray(weights, dtype=float)[keep]
    if not len(v):
        return 0.0
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    i = int(np.searchsorted(cum, q * cum[-1] * (1 - 1e-12), side="left"))
    return float(v[order][min(i, len(v) - 1)])


def prefill_window_rates(arrival_s: np.ndarray, tokens: np.ndarray, window_s: float) -> np.ndarray:
    """Per request: prompt tokens arriving in the trailing window (t - W, t] (itself included) ÷ W."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    t = np.asarray(arrival_s, dtype=float)
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(tokens, dtype=float))])
    last = np.searchsorted(t, t, side="right")  # requests at exactly t are in the window
    first = np.searchsorted(t, t - window_s, side="right")
    return (cum[last] - cum[first]) / window_s


def decode_concurrency(arrival_s: np.ndarray, output_tokens: np.ndarray, tpot_s: float
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise-constant number of requests decoding, each for output_tokens × tpot_s from its arrival:
    (levels, durations) of the segments between consecutive start/end events."""
    if tpot_s <= 0:
        raise ValueError("tpot_s must be > 0")
    start = np.asarray(arrival_s, dtype=float)
    end = start + np.asarray(output_tokens, dtype=float) * tpot_s
    times = np.concatenate([start, end])
    step = np.concatenate([np.ones(len(start)), -np.ones(len(end))])
    order = np.lexsort((step, times))  # at equal times, ends (-1) before starts
    times, level = times[order], np.cumsum(step[order])
    return level[:-1], np.diff(times)


def burst_factors(requests: RequestSet, ttft_slo_s: float, tpot_slo_s: float, q: float) -> tuple[float, float]:
    """(prefill, decode) planned ÷ mean token rate under the percentile rule (module doc) at percentile q."""
    if len(requests) < 2:
        return 1.0, 1.0
    span = requests.span_s
    mean_in = float(requests.input_tokens.sum()) / span
    rates = prefill_window_rates(requests.arrival_s, requests.input_tokens, ttft_slo_s)
    prefill = weighted_percentile(rates, requests.input_tokens.astype(float), q) / mean_in if mean_in > 0 else 1.0
    level, dt = decode_concurrency(requests.arrival_s, requests.output_tokens, tpot_slo_s)
    busy = float((level * dt).sum())
    mean_n = busy / float(dt.sum()) if dt.sum() > 0 else 0.0
    decode = weighted_percentile(level, level * dt, q) / mean_n if mean_n > 0 else 1.0
    return max(1.0, prefill), max(1.0, decode)
