"""Request-length classes (Mélange's setting): one model's requests split by length, each class with its own
throughput on every template, a template's capacity shared by the classes it serves.

Classes. `off` (the scenario default; whether classes pay is measured by benchmarks/classes.py) plans one class
with the scenario's means. `auto` derives classes from the model's trace: when the prompt lengths spread widely (p90 / p10 ≥ SPREAD_THRESHOLD),
the requests are cut into AUTO_CLASSES equal-count buckets of prompt length, each with its share of the
requests, its mean prompt and output lengths and its longest prompt (rescaled so that the classes' mean lengths
equal the scenario's `mean_input_tokens` / `mean_output_tokens`); otherwise, and for synthetic traces or `off`,
one class with the scenario's means (the plain scalar demand). An explicit list is used as given (sorted by
mean prompt length; a class without `max_input_tokens` ends halfway to the next class's mean).

Demand. Class c of a model gets the fraction share_c · len_c / Σ share · len of the phase's tokens/s (prefill:
prompt lengths, decode: output lengths), so the classes together ask for exactly the phase's demand.

Ratings. A template's throughput for class c is its stored throughput × B_c / B_0, B being the bottleneck stage
of its placement with per-node throughputs from the perf model's tables for that workload (B_c: the class's
lengths, B_0: the scenario's means, i.e. the workload the library was rated at). Prefill throughput falls with
the prompt length (attention cost under the TTFT budget), decode with the context (KV reads, KV memory per
sequence). With one class at the scenario's means the ratio is exactly 1.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from pydantic import ValidationError

from coral.allocation.reductions import vector_dominated
from coral.catalog.loader import Catalog, CoralInputError
from coral.catalog.schema import ScenarioModel
from coral.perf.model import Phase, Workload
from coral.perf.roofline import PerfParams, RooflineModel
from coral.templates.dominance import undominated
from coral.templates.library import TemplateLibrary, bottleneck
from coral.workload.traces import SHIPPED_TRACES, load_trace, shipped_path

EXACT_CHECK_PAIRS = 2_000_000  # (dropped × usable) templates up to which dropping is checked exactly
SPREAD_THRESHOLD = 4.0  # p90 / p10 of prompt lengths at or above which `auto` plans with classes
AUTO_CLASSES = 3


@dataclass(frozen=True)
class LengthClass:
    """One request class: share of the model's requests, its mean lengths (tokens) and the longest prompt it
    takes (None: no limit; routers send a request to the first class whose limit its prompt does not exceed)."""

    name: str
    share: float
    input_tokens: float
    output_tokens: float
    max_input_tokens: float | None = None

    @property
    def workload(self) -> Workload:
        return Workload(self.input_tokens, self.output_tokens)


def prompt_spread(input_tokens: np.ndarray) -> float:
    """p90 / p10 of the prompt lengths (1 for an empty or constant trace)."""
    if len(input_tokens) == 0:
        return 1.0
    p10, p90 = np.percentile(np.asarray(input_tokens, dtype=float), [10, 90])
    return float(p90 / max(p10, 1.0))


def quantile_classes(input_tokens: np.ndarray, output_tokens: np.ndarray, n: int = AUTO_CLASSES) -> list[LengthClass]:
    """`n` equal-count buckets of prompt length (ties kept in order of appearance), shortest first."""
    inp = np.asarray(input_tokens, dtype=float)
    out = np.asarray(output_tokens, dtype=float)
    if len(inp) < n or n < 1:
        raise ValueError(f"need at least {n} requests for {n} classes, got {len(inp)}")
    order = np.argsort(inp, kind="stable")
    buckets = np.array_split(order, n)
    return [LengthClass(f"q{i + 1}", len(b) / len(inp), float(inp[b].mean()), float(out[b].mean()),
                        float(inp[b].max()) if i < n - 1 else None)
            for i, b in enumerate(buckets)]


def _trace_lengths(trace: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Prompt and output lengths of a shipped trace; None for `synthetic`."""
    if trace not in SHIPPED_TRACES:
        return None
    req = load_trace(shipped_path(trace))
    return req.input_tokens, req.output_tokens


def model_classes(sm: ScenarioModel) -> list[LengthClass]:
    """The classes a scenario model is planned with (see the module docstring)."""
    mean = [LengthClass("all", 1.0, sm.mean_input_tokens, sm.mean_output_tokens)]
    if isinstance(sm.request_classes, list):
        given = sorted(sm.request_classes, key=lambda c: c.mean_input_tokens)
        limits: list[float | None] = [
            c.max_input_tokens if c.max_input_tokens is not None else (c.mean_input_tokens + d.mean_input_tokens) / 2
            for c, d in pairwise(given)]
        limits.append(None)
        return [LengthClass(c.name or f"c{i + 1}", c.share, c.mean_input_tokens, c.mean_output_tokens, lim)
                for i, (c, lim) in enumerate(zip(given, limits, strict=True))]
    if sm.request_classes == "off":
        return mean
    lengths = _trace_lengths(sm.trace)
    if lengths is None or len(lengths[0]) < AUTO_CLASSES or prompt_spread(lengths[0]) < SPREAD_THRESHOLD:
        return mean
    classes = quantile_classes(*lengths)
    f_in = sm.mean_input_tokens / sum(c.share * c.input_tokens for c in classes)
    f_out = sm.mean_output_tokens / sum(c.share * c.output_tokens for c in classes)
    return [LengthClass(c.name, c.share, c.input_tokens * f_in, c.output_tokens * f_out,
                        None if c.max_input_tokens is None else c.max_input_tokens * f_in) for c in classes]


def demand_split(classes: list[LengthClass], phase: Phase | str) -> np.ndarray:
    """Each class's fraction of the phase's tokens/s."""
    tokens = np.array([c.share * (c.input_tokens if str(phase) == "prefill" else c.output_tokens) for c in classes])
    return tokens / tokens.sum()


def library_perf(library: TemplateLibrary) -> RooflineModel:
    """The perf model the library was rated with: its stored parameters, or the current defaults when absent
    or written by an older parameter schema (class ratings only use ratios of two ratings of one model)."""
    raw = library.meta.get("perf_params")
    try:
        return RooflineModel(PerfParams.model_validate_json(raw) if raw else None)
    except ValidationError:
        return RooflineModel()


def class_ratings(library: TemplateLibrary, rows: np.ndarray, sm: ScenarioModel, phase: Phase | str,
                  classes: list[LengthClass], catalog: Catalog, perf: RooflineModel | None = None) -> np.ndarray:
    """(len(rows), len(classes)) tokens/s of templates `rows` (all of `sm`'s model and `phase`) per class."""
    phase = Phase(str(phase))
    perf = perf or library_perf(library)
    arch = catalog.model(sm.model)
    slo_s = (sm.prefill_slo_ms if phase is Phase.PREFILL else sm.decode_slo_ms) / 1e3
    nodes = library.nodes[rows].astype(np.int64)
    valid = nodes >= 0
    stage = library.node_stage[rows].astype(np.int64)
    layers = library.stage_layers[rows]
    n_stages = (layers > 0).sum(axis=1)
    node_layers = np.take_along_axis(layers, stage, axis=1).astype(np.int64)
    s_idx = np.broadcast_to((n_stages - 1)[:, None], nodes.shape)
    cfg = np.where(valid, nodes, 0)
    pairs = sorted({(int(s), int(c)) for s, c in zip(s_idx[valid], cfg[valid], strict=True)})

    def rate(workload: Workload) -> np.ndarray:
        table = np.zeros((max(int(n_stages.max(initial=1)), 1), len(library.configs), arch.num_hidden_layers + 1))
        for s, c in pairs:
            node = catalog.node_config(library.configs[c])
            table[s, c] = perf.throughput_table(arch, phase, node, slo_s, s + 1, workload)[0]
        per_node = np.where(valid, table[s_idx, cfg, node_layers], 0.0)
        return bottleneck(stage, per_node, layers)

    if len(rows) == 0:
        return np.zeros((0, len(classes)))
    base = rate(Workload(sm.mean_input_tokens, sm.mean_output_tokens))
    thr = library.throughput[rows].astype(float)
    out = np.zeros((len(rows), len(classes)))
    for k, c in enumerate(classes):
        if c.input_tokens == sm.mean_input_tokens and c.output_tokens == sm.mean_output_tokens:
            out[:, k] = thr
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, k] = np.where(base > 0, thr * rate(c.workload) / np.where(base > 0, base, 1.0), 0.0)
    if not np.isfinite(out).all():
        raise CoralInputError(f"request classes of {sm.model}/{phase}: non-finite class rating")
    return out


@dataclass
class KeyClasses:
    """One (model, phase) planned with classes: its usable templates, those kept by the reductions, their
    per-class ratings (rows of `usable`) and each class's fraction of the key's demand."""

    classes: list[LengthClass]
    usable: np.ndarray
    kept: np.ndarray
    ratings: np.ndarray
    split: np.ndarray

    def rating_of(self, templates: np.ndarray) -> np.ndarray:
        """(len(templates), K) ratings of template ids (all in `usable`)."""
        return self.ratings[np.searchsorted(self.usable, templates)]


_CACHE: dict[int, dict[tuple[object, ...], KeyClasses]] = {}


def key_classes(library: TemplateLibrary, sm: ScenarioModel, phase: Phase | str, usable: np.ndarray,
                kept: np.ndarray, catalog: Catalog) -> KeyClasses | None:
    """Classes of one (model, phase), or None when it is planned with one class. `usable`/`kept`: the key's
    templates and those the scalar reduction keeps (`rows.key_rows`). Kept with classes: those plus every
    template undominated under some class's rating. When (dropped × usable) ≤ EXACT_CHECK_PAIRS, a dropped template
    that no single template dominates in every class at once is kept again (exact); above, a template beaten in
    each class by a different sub-multiset stays dropped (a documented approximation: on extended with `auto`
    the exact check took 168 s and would have kept 869 more of 498,427 templates, on 2026-12-03's library).
    Memoised per library object (the ratings depend on the library, the SLO and the classes only)."""
    classes = model_classes(sm)
    if len(classes) < 2:
        return None
    cache = _CACHE.get(id(library))
    if cache is None:
        cache = _CACHE[id(library)] = {}
        weakref.finalize(library, _CACHE.pop, id(library), None)
    slo = sm.prefill_slo_ms if str(phase) == "prefill" else sm.decode_slo_ms
    key = (sm.model, str(phase), slo, sm.mean_input_tokens, sm.mean_output_tokens, tuple(classes))
    if key not in cache:
        ratings = class_ratings(library, usable, sm, phase, classes, catalog)
        keep = np.isin(usable, kept)
        for k in range(len(classes)):
            ok = ratings[:, k] > 0
            keep[np.flatnonzero(ok)[undominated(library.counts[usable[ok]], ratings[ok, k])]] = True
        dropped = np.flatnonzero(~keep)
        if len(dropped) * len(usable) <= EXACT_CHECK_PAIRS:  # exact where cheap: keep what no one row dominates
            keep[dropped[~vector_dominated(library.counts[usable], ratings, dropped)]] = True
        cache[key] = KeyClasses(classes, usable, usable[keep], ratings, demand_split(classes, phase))
    return cache[key]
