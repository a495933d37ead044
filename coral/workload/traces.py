"""Request traces: loaders for the Azure LLM inference and BurstGPT CSV formats, seeded synthetic generators,
rate rescaling, and the per-model workload of a scenario (built from the shipped traces or a user's files)."""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from coral.catalog.loader import CoralInputError, data_path
from coral.catalog.schema import MAX_RUN_REQUESTS, Scenario
from coral.catalog.suggest import did_you_mean

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")

#: trace names used in scenario files -> shipped file under coral/data/traces: the real Azure LLM inference 2023
#: traces (CC-BY 4.0) and a format-compatible synthetic stand-in for BurstGPT (see coral/data/traces/README.md)
SHIPPED_TRACES = {
    "azure-code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
    "azure-conversation": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
    "burstgpt": "burstgpt_sample.csv",
}


@dataclass(frozen=True)
class RequestSet:
    """Requests of one model: arrival times (s, sorted, first at 0), prompt and generated token counts, and,
    where tracked, `trace_s`: the time of each request in the trace it was read from (s from that trace's first
    request; the trace's own time scale, before any overlay, compression or tiling), which with its lengths
    names the recorded request behind it (`origins`). Sets read from a trace keep it; synthetic sets and sets
    built by hand leave it None."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str = ""
    trace_s: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_tokens) != n or len(self.output_tokens) != n:
            raise ValueError("arrival_s, input_tokens and output_tokens must have the same length")
        if self.trace_s is not None and len(self.trace_s) != n:
            raise ValueError("trace_s must have one entry per request")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        """Time the trace covers: last arrival plus one mean gap (so that tiling keeps the rate)."""
        n = len(self)
        if n == 0:
            return 0.0
        last = float(self.arrival_s[-1] - self.arrival_s[0])
        return last * n / (n - 1) if n > 1 else 1.0

    @property
    def rate(self) -> float:
        return len(self) / self.span_s if len(self) else 0.0

    @property
    def origin_s(self) -> np.ndarray:
        """Time of each request in its source trace: `trace_s` where tracked, else its arrival time from the first
        (a trace as loaded is its own source)."""
        if self.trace_s is not None:
            return self.trace_s
        return self.arrival_s - self.arrival_s[0] if len(self) else self.arrival_s

    def origins(self) -> set[tuple[float, int, int]]:
        """The recorded requests behind these: (time in the source trace, prompt tokens, generated tokens)."""
        return set(zip(self.origin_s.tolist(), self.input_tokens.tolist(), self.output_tokens.tolist(), strict=True))

    def _subset(self, keep: np.ndarray) -> RequestSet:
        return RequestSet(self.arrival_s[keep], self.input_tokens[keep], self.output_tokens[keep], self.source,
                          None if self.trace_s is None else self.trace_s[keep])

    def until(self, duration_s: float) -> RequestSet:
        return self._subset(self.arrival_s < duration_s)


def thinned(requests: Mapping[str, RequestSet], share: float | Mapping[str, float], seed: int
            ) -> dict[str, RequestSet]:
    """Each model's requests kept independently with probability `share` (one for all models, or per model;
    a model missing from the mapping keeps all), seeded."""
    rng = np.random.default_rng(seed)
    out = {}
    for m, r in requests.items():
        p = share if isinstance(share, float | int) else share.get(m, 1.0)
        keep = rng.random(len(r)) < p
        out[m] = r._subset(keep)
    return out


def _make(arrival: np.ndarray, inp: np.ndarray, out: np.ndarray, source: str,
          trace_s: np.ndarray | None = None) -> RequestSet:
    order = np.argsort(arrival, kind="stable")
    t = np.asarray(arrival, dtype=float)[order]
    t = t - t[0] if len(t) else t
    return RequestSet(
        t,
        np.maximum(np.asarray(inp, dtype=np.int64)[order], 1),
        np.maximum(np.asarray(out, dtype=np.int64)[order], 1),
        source,
        None if trace_s is None else np.asarray(trace_s, dtype=float)[order],
    )


def _read_rows(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in columns if c not in header]
            if missing:
                raise CoralInputError(f"{path}: missing column(s) {', '.join(missing)}; header is {header}")
            reader.fieldnames = header
            return list(reader)
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc


def _timestamps(values: list[str], path: Path) -> np.ndarray:
    """Seconds from numbers or ISO date-times such as '2023-11-16 18:15:46.6805900' or '...+00:00'."""
    try:
        return np.array([float(v) for v in values])
    except ValueError:
        pass
    cleaned = []
    for v in values:
        v = v.strip().replace(" ", "T")
        if v.endswith("Z"):
            v = v[:-1]
        elif len(v) > 6 and v[-6] in "+-" and v[-3] == ":":
            v = v[:-6]
        cleaned.append(v)
    try:
        stamps = np.array(cleaned, dtype="datetime64[ns]")
    except ValueError as exc:
        raise CoralInputError(f"{path}: TIMESTAMP: not a number or ISO date-time ({exc})") from exc
    return (stamps - stamps.min()).astype(np.int64) / 1e9


def _ints(rows: list[dict[str, str]], column: str, path: Path) -> np.ndarray:
    try:
        return np.array([int(float(r[column])) for r in rows], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise CoralInputError(f"{path}: column {column!r}: not an integer ({exc})") from exc


def load_azure(path: str | Path) -> RequestSet:
    """Azure LLM inference trace (2023 Splitwise / 2024 DynamoLLM): TIMESTAMP, ContextTokens, GeneratedTokens."""
    path = Path(path)
    rows = _read_rows(path, AZURE_COLUMNS)
    if not rows:
        raise CoralInputError(f"{path}: no requests")
    t = _timestamps([r["TIMESTAMP"] for r in rows], path)
    return _make(t, _ints(rows, "ContextTokens", path), _ints(rows, "GeneratedTokens", path), str(path))


def load_burstgpt(path: str | Path, model: str | None = None, log_type: str | None = None) -> RequestSet:
    """BurstGPT trace: Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type. Failed
    requests (0 response tokens) are dropped; `model` / `log_type` filter rows (e.g. 'ChatGPT', 'API log')."""
    path = Path(path)
    rows = _read_rows(path, BURSTGPT_COLUMNS)
    rows = [
        r for r in rows
        if (model is None or r["Model"] == model) and (log_type is None or r["Log Type"] == log_type)
    ]
    out = _ints(rows, "Response tokens", path)
    ok = out > 0
    if not ok.any():
        raise CoralInputError(f"{path}: no successful requests (after filters model={model}, log_type={log_type})")
    t = _timestamps([r["Timestamp"] for r in rows], path)
    return _make(t[ok], _ints(rows, "Request tokens", path)[ok], out[ok], str(path))


def load_trace(path: str | Path) -> RequestSet:
    """Azure or BurstGPT file, told apart by the header."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            header = {h.strip() for h in next(csv.reader(f), [])}
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc
    if "ContextTokens" in header:
        return load_azure(path)
    if "Request tokens" in header:
        return load_burstgpt(path)
    raise CoralInputError(f"{path}: neither an Azure ({', '.join(AZURE_COLUMNS)}) nor a BurstGPT trace header")


def lognormal_lengths(
    rng: np.random.Generator, n: int, mean: float, sigma: float, cap: int | None = None
) -> np.ndarray:
    """Integer lengths >= 1, lognormal with the given mean (after clipping to `cap`)."""
    x = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
    for _ in range(4):
        x = np.clip(x, 1, cap) if cap else np.maximum(x, 1)
        x *= mean / x.mean()
    x = np.clip(x, 1, cap) if cap else np.maximum(x, 1)
    return np.maximum(np.rint(x), 1).astype(np.int64)


def synthetic(
    rate: float,
    duration_s: float,
    mean_input: float,
    mean_output: float,
    *,
    seed: int,
    arrival: Literal["poisson", "gamma"] = "poisson",
    cv: float = 2.0,
    sigma_input: float = 0.8,
    sigma_output: float = 1.0,
    max_input: int | None = 16384,
    max_output: int | None = 4096,
) -> RequestSet:
    """Seeded requests: Poisson or gamma (bursty, coefficient of variation `cv`) arrivals, lognormal lengths."""
    if rate <= 0 or duration_s <= 0:
        return _make(np.zeros(0), np.zeros(0), np.zeros(0), "synthetic")
    rng = np.random.default_rng(seed)
    n_guess = int(rate * duration_s * 1.2 + 10 * np.sqrt(rate * duration_s) + 10)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, n_guess)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n_guess)
    t = np.cumsum(gaps) - gaps[0]
    t = t[t < duration_s]
    n = len(t)
    inp = lognormal_lengths(rng, n, mean_input, sigma_input, max_input)
    out = lognormal_lengths(rng, n, mean_output, sigma_output, max_output)
    return RequestSet(t, inp, out, f"synthetic:{arrival}")


def rescale(requests: RequestSet, rate: float) -> RequestSet:
    """Compress or stretch arrival times uniformly so that the mean rate becomes `rate` requests/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if len(requests) < 2:
        return requests
    factor = requests.rate / rate
    return RequestSet(requests.arrival_s * factor, requests.input_tokens, requests.output_tokens, requests.source,
                      requests.origin_s)


def tile(requests: RequestSet, duration_s: float, seed: int) -> RequestSet:
    """Repeat a trace until it covers `duration_s`; each pass (the first too) starts at a seeded random point of
    the trace (circular shift), which keeps its local burst structure without replaying it in lock-step."""
    if not len(requests):
        return requests
    span = requests.span_s
    rng = np.random.default_rng(seed)
    n = len(requests)
    origin = requests.origin_s
    parts_t, parts_i, parts_o, parts_s = [], [], [], []
    offset = 0.0
    while offset < duration_s:
        shift = int(rng.integers(n))
        idx = np.roll(np.arange(n), -shift)
        t = requests.arrival_s[idx] - requests.arrival_s[idx[0]]
        t = np.where(t < 0, t + span, t)
        parts_t.append(t + offset)
        parts_i.append(requests.input_tokens[idx])
        parts_o.append(requests.output_tokens[idx])
        parts_s.append(origin[idx])
        offset += span
    return _make(
        np.concatenate(parts_t), np.concatenate(parts_i), np.concatenate(parts_o), requests.source,
        np.concatenate(parts_s),
    ).until(duration_s)


def _from_time(requests: RequestSet, start_s: float, duration_s: float) -> RequestSet:
    """The trace read from `start_s` of its span on, wrapping around (circularly), for `duration_s`."""
    span = requests.span_s
    t = (requests.arrival_s - requests.arrival_s[0] - start_s) % span
    order = np.argsort(t, kind="stable")
    reps = max(1, math.ceil(duration_s / span))
    times = np.concatenate([t[order] + k * span for k in range(reps)])
    keep = times < duration_s
    return RequestSet(times[keep], np.tile(requests.input_tokens[order], reps)[keep],
                      np.tile(requests.output_tokens[order], reps)[keep], requests.source,
                      np.tile(requests.origin_s[order], reps)[keep])


def superpose(requests: RequestSet, rate: float, duration_s: float, seed: int) -> RequestSet:
    """Reach `rate` requests/s by overlaying independent segments of the trace at its own time scale: n =
    ceil(rate / trace rate) segments, each read from its own seeded uniformly random time of the trace (wrapping
    around), each request kept with probability rate / (n · trace rate). Unlike `rescale`, which compresses
    time and so packs every clump of the trace n times denser, independent segments add up as independent users
    would; the length distribution is the trace's."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if len(requests) < 2:
        return rescale(requests, rate)
    n = max(1, math.ceil(rate / requests.rate - 1e-9))
    keep = rate / (n * requests.rate)
    rng = np.random.default_rng(seed)
    parts = [_from_time(requests, float(rng.uniform(0, requests.span_s)), duration_s) for _ in range(n)]
    t = np.concatenate([p.arrival_s for p in parts])
    mask = rng.random(len(t)) < keep
    order = np.argsort(t[mask], kind="stable")
    inp = np.concatenate([p.input_tokens for p in parts])[mask][order]
    out = np.concatenate([p.output_tokens for p in parts])[mask][order]
    origin = np.concatenate([p.origin_s for p in parts])[mask][order]
    return RequestSet(t[mask][order], inp, out, requests.source, origin)


#: which part of each trace's time range a request set reads: the planner tunes on "tune" sets and scores plans on
#: "held_out" sets, so a held-out request is one the planner never saw (module `coral.planning.slo_search`)
TracePart = Literal["tune", "held_out"]
TRACE_PARTS: tuple[TracePart, ...] = ("tune", "held_out")

#: share of every trace's time span (from its first request) that tuning sets read; held-out sets read the rest.
#: Half and half: the two held-out half hours a verdict rests on get as much distinct recorded traffic as the
#: tuning sets (each half of the shipped Azure traces is about 29 minutes, about the 30-minute run they fill,
#: so a set replays its part about once rather than several times over); contiguous halves rather than
#: interleaved blocks, because requests a few seconds apart belong to the same burst, and a block boundary
#: every few minutes would let a tuning burst run on into a held-out one.
TRACE_SPLIT = 0.5


def part_bounds(part: TracePart, split: float = TRACE_SPLIT) -> tuple[float, float]:
    """(start, end) of a part as shares of a trace's span: tune [0, split), held_out [split, 1)."""
    if not 0.0 < split < 1.0:
        raise ValueError("split must be in (0, 1)")
    if part == "tune":
        return 0.0, split
    if part == "held_out":
        return split, 1.0
    raise ValueError(f"trace part must be one of {', '.join(TRACE_PARTS)}, not {part!r}")


def trace_part(requests: RequestSet, part: TracePart, split: float = TRACE_SPLIT) -> RequestSet:
    """The requests of one part of a trace's time range (`part_bounds`), arrival times from the part's first
    request; `trace_s` keeps each one's time in the whole trace. Superposing or tiling the result reads (and
    wraps around) only that part."""
    lo, hi = part_bounds(part, split)
    if not len(requests):
        return requests
    span = requests.span_s
    rel = requests.arrival_s - requests.arrival_s[0]
    keep = (rel >= lo * span) & (rel < hi * span)
    if keep.sum() < 2:
        raise CoralInputError(f"{requests.source or 'trace'}: its {part} part ({lo:.0%} to {hi:.0%} of "
                              f"{span:.0f} s) holds {int(keep.sum())} request(s); at least 2 are needed")
    return _make(rel[keep], requests.input_tokens[keep], requests.output_tokens[keep], requests.source,
                 requests.origin_s[keep])


def shipped_path(trace: str) -> Path:
    """File of a shipped trace named in scenario files (`azure-code`, `azure-conversation`, `burstgpt`); an
    unknown name is a CoralInputError listing them."""
    if trace not in SHIPPED_TRACES:
        raise CoralInputError(f"{trace!r} is not a shipped trace; shipped: {', '.join(SHIPPED_TRACES)}")
    return data_path("traces", *SHIPPED_TRACES[trace].split("/"))


#: shipped traces that are synthetic stand-ins in a real trace's format, not recorded traffic
SYNTHETIC_STAND_INS = frozenset({"burstgpt"})

TraceScaling = Literal["superpose", "compress"]


@functools.lru_cache(maxsize=8)
def _shipped(trace: str) -> RequestSet:
    return load_trace(shipped_path(trace))


def workload_for(
    scenario: Scenario,
    duration_s: float,
    seed: int,
    traces: Mapping[str, str | Path] | None = None,
    rate_scale: float = 1.0,
    scaling: TraceScaling | None = None,
    part: TracePart | None = None,
) -> dict[str, RequestSet]:
    """Requests of every scenario model over `duration_s`: its trace (a user file from `traces[model]`, else
    the shipped trace named by the scenario, else synthetic Poisson with the scenario's means), brought to the
    model's request rate x `rate_scale` by `scaling` (default: the scenario's `trace_scaling`): "superpose"
    overlays independent segments of the trace (`superpose`), "compress" compresses time (`rescale`) and
    tiles the result to the duration. Each seed draws other segments: other requests of the same traffic.

    `part` ("tune" or "held_out", `TracePart`) reads only that part of each trace's time range (`trace_part`:
    the first `TRACE_SPLIT` of its span, or the rest), so that no request of a held-out set is a request of a
    tuning set, whatever the seeds; synthetic models draw from a random stream of their own per part. None
    (the default) reads the whole trace, as simulations and experiments that neither tune nor score a plan do."""
    expected = sum(m.request_rate for m in scenario.models) * rate_scale * duration_s
    if not 0 < duration_s < math.inf or expected > MAX_RUN_REQUESTS:
        raise CoralInputError(f"duration: {duration_s:g} s of {scenario.name}'s traffic (x{rate_scale:g}) is about "
                              f"{expected:,.0f} requests; a run holds more than 0 s and at most "
                              f"{MAX_RUN_REQUESTS:,} requests")
    traces = traces or {}
    how = scaling or scenario.trace_scaling
    if how not in ("superpose", "compress"):
        raise CoralInputError(f"trace scaling must be 'superpose' or 'compress', not {how!r}")
    if part is not None:
        part_bounds(part)  # names the parts when `part` is none of them
    out: dict[str, RequestSet] = {}
    for i, m in enumerate(scenario.models):
        rate = m.request_rate * rate_scale
        sub_seed = seed * 1009 + i if part is None else _part_seed(seed, i, part)
        if rate <= 0:
            out[m.model] = _make(np.zeros(0), np.zeros(0), np.zeros(0), "none")
            continue
        if m.model in traces:
            base = load_trace(traces[m.model])
        elif m.trace in SHIPPED_TRACES:
            base = _shipped(m.trace)
        elif m.trace == "synthetic":
            out[m.model] = synthetic(rate, duration_s, m.mean_input_tokens, m.mean_output_tokens, seed=sub_seed)
            continue
        else:
            raise CoralInputError(
                f"scenario {scenario.name}: models.{i}.trace: unknown trace {m.trace!r}"
                f"{did_you_mean(m.trace, [*SHIPPED_TRACES, 'synthetic'])}; known: "
                f"{', '.join([*SHIPPED_TRACES, 'synthetic'])} (or pass a file with --trace {m.model}=PATH)"
            )
        if part is not None:
            base = trace_part(base, part)
        out[m.model] = (superpose(base, rate, duration_s, sub_seed) if how == "superpose"
                        else tile(rescale(base, rate), duration_s, sub_seed))
    return out


def _part_seed(seed: int, index: int, part: TracePart) -> int:
    """Seed of a scenario model's requests in one part: its own stream per (seed, model index, part)."""
    return int(np.random.SeedSequence([seed, index, TRACE_PARTS.index(part)]).generate_state(1)[0])


def request_sets(
    scenario: Scenario,
    duration_s: float,
    tune_seeds: tuple[int, ...],
    held_out_seeds: tuple[int, ...],
    traces: Mapping[str, str | Path] | None = None,
) -> list[dict[str, object]]:
    """What the tuning and the held-out request sets of a scenario hold, one row per (model, part): the seeds,
    the requests simulated (over all of the part's seeds), the minutes simulated, the part of the trace read
    (`trace_from_min`, `trace_to_min`, `trace_minutes`, `trace_requests`: its recorded requests; None for
    synthetic models, which draw fresh requests), how many distinct recorded requests the sets use, and
    `shared`: how many recorded requests the two parts' sets of the model have in common (0 by construction)."""
    traces = traces or {}
    seeds: dict[TracePart, tuple[int, ...]] = {"tune": tuple(tune_seeds), "held_out": tuple(held_out_seeds)}
    made = {p: [workload_for(scenario, duration_s, s, traces, part=p) for s in seeds[p]] for p in TRACE_PARTS}
    rows: list[dict[str, object]] = []
    for m in scenario.models:
        if m.model in traces:
            base: RequestSet | None = load_trace(traces[m.model])
        elif m.trace in SHIPPED_TRACES:
            base = _shipped(m.trace)
        else:
            base = None
        used: dict[TracePart, set[tuple[float, int, int]]] = {}
        for p in TRACE_PARTS:
            sets = [w[m.model] for w in made[p]]
            used[p] = set().union(*(r.origins() for r in sets if r.trace_s is not None))
            row: dict[str, object] = {
                "model": m.model, "trace": str(traces.get(m.model, m.trace)), "part": p,
                "seeds": list(seeds[p]), "requests": sum(len(r) for r in sets),
                "minutes": round(len(sets) * duration_s / 60.0, 2),
                "trace_from_min": None, "trace_to_min": None, "trace_minutes": None, "trace_requests": None,
                "distinct_used": len(used[p]) if base is not None else None,
            }
            if base is not None and len(base):
                lo, hi = part_bounds(p)
                span = base.span_s
                rel = base.arrival_s - base.arrival_s[0]
                row.update(trace_from_min=round(lo * span / 60.0, 2), trace_to_min=round(hi * span / 60.0, 2),
                           trace_minutes=round((hi - lo) * span / 60.0, 2),
                           trace_requests=int(((rel >= lo * span) & (rel < hi * span)).sum()))
            rows.append(row)
        shared = len(used["tune"] & used["held_out"]) if base is not None else None
        for row in rows[-len(TRACE_PARTS):]:
            row["shared"] = shared
    return rows


def stand_in_notes(scenario: Scenario, traces: Mapping[str, str | Path] | None = None) -> list[str]:
    """One line per model whose traffic is not recorded traffic (a synthetic stand-in or a generator)."""
    traces = traces or {}
    notes = []
    for m in scenario.models:
        if m.model in traces:
            continue
        if m.trace in SYNTHETIC_STAND_INS:
            notes.append(f"{m.model}: trace {m.trace!r} is a synthetic stand-in in that trace's format, not "
                         "recorded traffic (coral/data/traces/README.md)")
        elif m.trace == "synthetic":
            notes.append(f"{m.model}: synthetic Poisson arrivals with lognormal lengths, not recorded traffic")
    return notes


def write_azure(requests: RequestSet, path: str | Path, start: str = "2023-11-16T18:00:00") -> Path:
    """Write requests in the Azure trace format (date-time TIMESTAMP with 7 fractional digits)."""
    path = Path(path)
    t0 = np.datetime64(start, "ns")
    stamps = t0 + np.rint(requests.arrival_s * 1e9).astype("timedelta64[ns]")
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(AZURE_COLUMNS)
        for s, i, o in zip(stamps, requests.input_tokens, requests.output_tokens, strict=True):
            text = str(s).replace("T", " ")[:27]
            w.writerow([text, int(i), int(o)])
    return path


def write_burstgpt(
    requests: RequestSet, path: str | Path, models: np.ndarray, log_types: np.ndarray
) -> Path:
    """Write requests in the BurstGPT format (Timestamp in seconds)."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(BURSTGPT_COLUMNS)
        for t, i, o, m, lt in zip(
            requests.arrival_s, requests.input_tokens, requests.output_tokens, models, log_types, strict=True
        ):
            w.writerow([f"{t:.3f}", m, int(i), int(o), int(i + o), lt])
    return path


def generate_burstgpt_sample(folder: str | Path, seed: int = 2028, n: int = 2000) -> Path:
    """Write the shipped BurstGPT sample: a seeded synthetic stand-in in BurstGPT's format with the workload means
    the scenarios assume (see coral/data/traces/README.md). Run `python -m coral.workload.traces` to regenerate
    it byte for byte."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rate, cv = 1.0, 3.0
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    t = np.cumsum(gaps) - gaps[0]
    inp = lognormal_lengths(rng, n, 611.0, 0.9, 4096)
    out = lognormal_lengths(rng, n, 123.0, 1.0, 2048)
    models = np.where(rng.random(n) < 0.85, "ChatGPT", "GPT-4")
    logs = np.where(rng.random(n) < 0.7, "Conversation log", "API log")
    failed = rng.random(n) < 0.02
    requests = RequestSet(t, inp, np.where(failed, 0, out), "burstgpt")
    return write_burstgpt(requests, folder / SHIPPED_TRACES["burstgpt"], models, logs)


if __name__ == "__main__":
    print(generate_burstgpt_sample(data_path("traces")))
