"""Templates rated by what a request pays on them, not by throughput alone: the share of a model's requests that
meet the phase's SLO when served alone on a template (no queueing), with the hop, chunking and KV hand-off
costs the simulator charges (`coral.perf.latency`). Queueing only adds to these, so a template whose share is
short of the model's target cannot meet it with any capacity: buying more of it only raises the cost.

Per request of the model's tuning workload (a fixed sample of `SAMPLE` requests, evenly spaced in arrival order)
and per template, over every path a request may take (one node per stage, each picked with the router's weight,
its node throughput; the share is the paths' weighted mean):

- prefill: TTFT = the chunked prompt through the stages (`chunked_prefill_s`, chunks of the node's planned
  batch, step times of the simulator's tables) ≤ the TTFT SLO; and its side of the KV hand-off must leave the
  decode room: send + (o − 1) × the fastest decode cycle of any of the model's decode templates ≤ (o − 1) × the
  TPOT SLO (the TPOT clock starts at the first token, so the hand-off is charged to the decode SLO);
- decode: receive + (o − 1) × the pipeline's single-sequence cycle (sum of the stages' step times at batch 1, at
  the request's mean decode context) ≤ (o − 1) × the TPOT SLO (requests of one output token have no TPOT).

The pooled rule (`KeyLatency`). Latency misses of one phase may take at most a quarter (`ALLOWANCE_SHARE` = β)
of the model's allowed misses (1 − target), so both phases together take at most half and queueing keeps the
rest. The allocator asks it of each (model, phase)'s instances together, not of each template: requests spread
over a key's instances in proportion to their throughput, so the share missed is the capacity-weighted mean of
the templates' misses, and one row per key, Σ_j T_j x_j (level − share_j) ≤ 0 (`core.assemble`), keeps it at
most β (1 − target) (level = the floor 1 − β (1 − target)). A cheap template short of the floor can so be mixed
with ones above it; every plan the former per-template floor allowed still meets the row, so a plan is never
dearer than under it. The ratio form (not a bound on β (1 − target) × demand) holds whatever share of demand a
plan serves and however much spare capacity it carries. Each template must still reach the target itself
(`kept`, a sanity floor: a template most of whose requests miss would only add misses that the queueing's
share of the allowance cannot absorb). Candidates are the templates undominated (library reduction 2) among
those kept, together with those undominated among the templates at or above the level (what the former floor
kept stays a candidate; a throughput dominator short of the level no longer removes one). A model none of
whose templates reaches the floor is *latency-bound*: its level is its best share less the quarter allowance,
and the ceiling is reported (`LatencyBound`), since no capacity can lift attainment above what its requests
reach served alone.

Ratings are computed once per library object (memoised) and, for a library read from a file, cached beside it
(`RatingCache`), so a re-plan in a new process reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import weakref
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from coral.allocation.classes import library_perf
from coral.allocation.demand import model_key, tuning_requests
from coral.allocation.rows import key_rows, restricted_rows
from coral.catalog.loader import Catalog, NodeConfig
from coral.catalog.schema import Scenario, ScenarioModel
from coral.perf import latency as latency_model
from coral.perf import model as perf_model
from coral.perf import roofline
from coral.perf.latency import chunked_prefill_s, handoff_side_s, prefill_chunks_s
from coral.perf.model import Phase, Workload
from coral.perf.roofline import RooflineModel
from coral.templates.library import TemplateLibrary

SAMPLE = 384  # requests of the tuning workload each template is rated on
CHUNK = 8192  # templates rated at once (memory: CHUNK × slots × SAMPLE floats)
ALLOWANCE_SHARE = 0.25  # β: of a model's allowed misses, what one phase's latency may take


@dataclass(frozen=True)
class RequestSample:
    input_tokens: np.ndarray
    output_tokens: np.ndarray


_SAMPLES: dict[str, RequestSample] = {}


def request_sample(scenario: Scenario, sm: ScenarioModel) -> RequestSample:
    """`SAMPLE` requests of the model's tuning workload, evenly spaced in arrival order (memoised)."""
    key = model_key(scenario, sm)
    if key not in _SAMPLES:
        req = tuning_requests(scenario, sm)
        idx = np.unique(np.linspace(0, max(len(req) - 1, 0), SAMPLE).astype(np.int64)) if len(req) else np.zeros(
            0, dtype=np.int64)
        _SAMPLES[key] = RequestSample(np.asarray(req.input_tokens)[idx].astype(np.int64),
                                      np.asarray(req.output_tokens)[idx].astype(np.int64))
    return _SAMPLES[key]


@dataclass(frozen=True)
class KeyLatency:
    """One (model, phase): its usable templates, the share of sampled requests each serves within the SLO alone,
    the floor and level of the pooled rule, and the templates kept and candidates for planning (module doc)."""

    model: str
    phase: Phase
    rows: np.ndarray
    share: np.ndarray
    floor: float  # 1 − β (1 − target): the share a key's instances must reach together
    level: float  # the floor, or for a latency-bound key its best share less β (1 − target)
    kept: np.ndarray  # template ids whose share reaches the target (or the level, when lower), sorted
    candidates: np.ndarray  # the undominated among `kept` (module doc), sorted

    @property
    def best(self) -> float:
        return float(self.share.max(initial=0.0))

    @property
    def bound(self) -> bool:
        """Latency-bound: no template reaches the floor."""
        return self.best < self.floor

    def shortfall(self, templates: np.ndarray) -> np.ndarray:
        """level − share of each of `templates` (ids among `rows`): its coefficient per token/s in the pooled row."""
        return self.level - self.share[np.searchsorted(self.rows, templates)]


@dataclass(frozen=True)
class _Slots:
    """Per-slot layout of template rows: config, stage, layers, pipeline depth, validity, the slot's rank among its
    stage's nodes, its share of the stage's traffic (the router's weight: node throughput) and the stage sizes."""

    cfg: np.ndarray
    stage: np.ndarray
    layers: np.ndarray
    n_stages: np.ndarray
    valid: np.ndarray
    rank: np.ndarray
    weight: np.ndarray
    size: np.ndarray  # (rows, W) nodes per stage

    def paths(self, sel: slice) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(rows, on-path mask (len(rows), W), probability (len(rows),)) for every path a request may take through
        rows `sel` (indices into the chunk): one node per stage, picked in proportion to node throughput."""
        size = np.maximum(self.size[sel], 1)
        n_paths = size.prod(axis=1)
        radix = np.concatenate([np.ones((len(size), 1), dtype=np.int64), np.cumprod(size, axis=1)[:, :-1]], axis=1)
        stage, valid, rank, weight = self.stage[sel], self.valid[sel], self.rank[sel], self.weight[sel]
        for p in range(int(n_paths.max(initial=1))):
            rows = np.flatnonzero(p < n_paths)
            choice = (p // radix[rows]) % size[rows]  # node rank chosen in each stage
            on = valid[rows] & (rank[rows] == np.take_along_axis(choice, stage[rows], axis=1))
            yield rows, on, np.where(on, weight[rows], 1.0).prod(axis=1)


def _slots(library: TemplateLibrary, rows: np.ndarray) -> _Slots:
    nodes = library.nodes[rows].astype(np.int64)
    valid = nodes >= 0
    width = nodes.shape[1]
    stage = library.node_stage[rows].astype(np.int64)
    stage_layers = library.stage_layers[rows].astype(np.int64)
    layers = np.where(valid, np.take_along_axis(stage_layers, stage, axis=1), 0)
    same = (stage[:, :, None] == stage[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    rank = np.tril(same, k=-1).sum(axis=2)  # earlier slots of the same stage
    size = np.stack([((stage == st) & valid).sum(axis=1) for st in range(width)], axis=1)
    thr = np.where(valid, library.node_throughput[rows], 0.0)
    stage_thr = np.take_along_axis(np.stack([np.where(stage == st, thr, 0.0).sum(axis=1) for st in range(width)], 1),
                                   stage, axis=1)
    share = np.where(valid & (stage_thr > 0), thr / np.where(stage_thr > 0, stage_thr, 1.0), 0.0)
    count = np.take_along_axis(size, stage, axis=1)
    weight = np.where(stage_thr > 0, share, 1.0 / np.maximum(count, 1))
    return _Slots(np.where(valid, nodes, 0), stage, layers, (stage_layers > 0).sum(axis=1), valid, rank, weight,
                  size)


def _nic_bytes_s(library: TemplateLibrary, catalog: Catalog) -> np.ndarray:
    return np.array([catalog.node_config(c).nic_bytes_s for c in library.configs])


def _decode_cycle_terms(library: TemplateLibrary, catalog: Catalog, perf: RooflineModel, sm: ScenarioModel
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of shape (C, S_max, L+1): a node of config c in an S-stage pipeline holding j layers steps one
    sequence of decode context x in A + B × attended(x) seconds (the perf model's decode step is affine in it)."""
    arch = catalog.model(sm.model)
    shape = perf.shape(arch)
    j = np.arange(arch.num_hidden_layers + 1)
    n_max = library.nodes.shape[1]
    a = np.zeros((len(library.configs), n_max, len(j)))
    b = np.zeros_like(a)
    x1, x2 = 256.0, 4096.0
    att1, att2 = float(shape.attended_tokens(x1)), float(shape.attended_tokens(x2))
    for c, name in enumerate(library.configs):
        node = catalog.node_config(name)
        for s in range(n_max):
            t1 = perf.step_time(arch, Phase.DECODE, node, j, 1.0, Workload(x1, 0.0), s > 0)
            t2 = perf.step_time(arch, Phase.DECODE, node, j, 1.0, Workload(x2, 0.0), s > 0)
            slope = (t2 - t1) / (att2 - att1) if att2 > att1 else np.zeros_like(t1)
            a[c, s], b[c, s] = t1 - slope * att1, slope
    return a, b


def _prefill_chunk_times(library: TemplateLibrary, catalog: Catalog, perf: RooflineModel, sm: ScenarioModel,
                         prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first chunk, all chunks) seconds, each (C, S_max, L+1, R), of the sampled prompts on a node of config c
    in an S-stage pipeline holding j layers, in chunks of the node's planned batch (as the simulator runs it)."""
    arch = catalog.model(sm.model)
    w = Workload(sm.mean_input_tokens, sm.mean_output_tokens)
    n_layers = arch.num_hidden_layers
    n_max = library.nodes.shape[1]
    first = np.zeros((len(library.configs), n_max, n_layers + 1, len(prompts)))
    total = np.zeros_like(first)
    j = np.arange(1, n_layers + 1)
    for c, name in enumerate(library.configs):
        node = catalog.node_config(name)
        for s in range(n_max):
            _, batch = perf.throughput_table(arch, Phase.PREFILL, node, sm.prefill_slo_ms / 1e3, s + 1, w)
            cap = np.where(batch[1:] > 0, batch[1:], w.input_tokens).astype(np.int64)[:, None]

            def step(x: np.ndarray, node: NodeConfig = node, send: bool = s > 0) -> np.ndarray:
                return np.asarray(perf.step_time(arch, Phase.PREFILL, node, j[:, None], x, w, send), dtype=float)

            first[c, s, 1:], total[c, s, 1:] = prefill_chunks_s(step, cap, prompts[None, :])
    return first, total


def _decode_shares(library: TemplateLibrary, rows: np.ndarray, sample: RequestSample, kv: np.ndarray,
                   att: np.ndarray, ab: tuple[np.ndarray, np.ndarray], nic: np.ndarray, tpot_s: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(share within the TPOT SLO per row, fastest single-sequence cycle per sampled request over the rows)."""
    a_tab, b_tab = ab
    s = _slots(library, rows)
    o = sample.output_tokens.astype(float)[None, :]
    share = np.zeros(len(rows))
    fastest = np.full(o.shape[1], np.inf)
    for lo in range(0, len(rows), CHUNK):
        sel = slice(lo, lo + CHUNK)
        depth = (s.n_stages[sel] - 1)[:, None]
        cfg, layers = s.cfg[sel], s.layers[sel]
        a_node, b_node, nic_node = a_tab[cfg, depth, layers], b_tab[cfg, depth, layers], nic[cfg]
        out = share[sel]
        for rows, on, prob in s.paths(sel):
            a = np.where(on, a_node[rows], 0.0).sum(axis=1)[:, None]
            b = np.where(on, b_node[rows], 0.0).sum(axis=1)[:, None]
            cycle = a + b * att[None, :]  # (rows, R): one token's pass over the path, alone
            recv = handoff_side_s(kv[None, :], np.where(on, layers[rows], 0)[:, None, :], nic_node[rows][:, None, :])
            ok = (o <= 1) | (recv + (o - 1) * cycle <= (o - 1) * tpot_s + 1e-12)
            out[rows] += prob * ok.mean(axis=1)
            fastest = np.minimum(fastest, cycle.min(axis=0))
    return share, fastest


def _prefill_shares(library: TemplateLibrary, rows: np.ndarray, sample: RequestSample, kv: np.ndarray,
                    chunks: tuple[np.ndarray, np.ndarray], prompts: np.ndarray, nic: np.ndarray, ttft_s: float,
                    tpot_s: float, fastest_cycle: np.ndarray) -> np.ndarray:
    """Share of sampled requests within the TTFT SLO, whose hand-off side leaves the decode its room, per row.
    `chunks` are the chunk times of the sorted distinct sampled `prompts`; a prompt's TTFT does not fall as it
    grows, so each path's longest prompt within the SLO is found by bisection."""
    first_tab, total_tab = chunks
    s = _slots(library, rows)
    o = sample.output_tokens.astype(float)
    rank = np.searchsorted(prompts, sample.input_tokens)[None, :]  # each sampled request's prompt among `prompts`
    decode_room = np.where(o > 1, (o - 1) * (tpot_s - fastest_cycle), np.inf)[None, :]  # what the hand-off may take
    share = np.zeros(len(rows))
    for lo in range(0, len(rows), CHUNK):
        sel = slice(lo, lo + CHUNK)
        depth = (s.n_stages[sel] - 1)[:, None]
        cfg, layers = s.cfg[sel], s.layers[sel]
        nic_node = nic[cfg]
        out = share[sel]
        for rows_p, on, prob in s.paths(sel):
            c, d, j = cfg[rows_p], depth[rows_p], layers[rows_p]

            def fits(k: np.ndarray, c: np.ndarray = c, d: np.ndarray = d, j: np.ndarray = j, on: np.ndarray = on
                     ) -> np.ndarray:
                kk = np.broadcast_to(k[:, None], c.shape)
                first = np.where(on, first_tab[c, d, j, kk], 0.0)
                ttft = chunked_prefill_s(first, np.where(on, total_tab[c, d, j, kk], 0.0))
                return np.asarray(ttft <= ttft_s + 1e-12)

            below = np.zeros(len(rows_p), dtype=np.int64)  # prompts[:below] fit, prompts[above:] do not
            above = np.full(len(rows_p), len(prompts), dtype=np.int64)
            while (below < above).any():
                mid = (below + above) // 2
                ok = fits(np.minimum(mid, len(prompts) - 1)) & (below < above)
                below = np.where(ok, mid + 1, below)
                above = np.where(ok | (below >= above), above, mid)
            send = handoff_side_s(kv[None, :], np.where(on, j, 0)[:, None, :], nic_node[rows_p][:, None, :])
            good = (rank < below[:, None]) & (send <= decode_room + 1e-12)
            out[rows_p] += prob * good.mean(axis=1)
    return share


_CACHE: dict[int, dict[tuple[object, ...], dict[Phase, KeyLatency]]] = {}


def key_latency(library: TemplateLibrary, model: str, phase: Phase, rows: np.ndarray, share: np.ndarray,
                target: float, candidates: np.ndarray | None = None) -> KeyLatency:
    """One key's rating from its templates' shares (`rows` ascending, as `key_rows` gives them) at the model's
    attainment `target` (module doc): the floor, the pooled level, the templates kept and the candidates among
    them (computed unless given, e.g. read from the cache)."""
    allowance = (1.0 - target) * ALLOWANCE_SHARE
    floor = 1.0 - allowance
    best = float(share.max(initial=0.0))
    level = floor if best >= floor - 1e-12 else best - allowance
    kept = rows[share >= min(target, level) - 1e-12]
    if candidates is None:
        usable, undominated = key_rows(library, model, str(phase), False)
        good = rows[share >= level - 1e-12]
        candidates = np.union1d(restricted_rows(library, usable, undominated, kept)[1],
                                restricted_rows(library, usable, undominated, good)[1])
    return KeyLatency(model, phase, rows, share, floor, level, kept, candidates)


def model_latency(library: TemplateLibrary, scenario: Scenario, sm: ScenarioModel, catalog: Catalog,
                  perf: RooflineModel | None = None) -> dict[Phase, KeyLatency]:
    """Both phases of one model rated (module doc); memoised per library object, model and SLOs, and cached on
    disk beside a library loaded from a file (`RatingCache`)."""
    cache = _CACHE.get(id(library))
    if cache is None:
        cache = _CACHE[id(library)] = {}
        weakref.finalize(library, _CACHE.pop, id(library), None)
    key = (model_key(scenario, sm), tuple(catalog.node_config(c).nic_gbps for c in library.configs))
    if key in cache:
        return cache[key]
    perf = perf or library_perf(library)
    sample = request_sample(scenario, sm)
    rows = {phase: key_rows(library, sm.model, str(phase), False)[0] for phase in Phase}
    disk = RatingCache.of(library)
    digest = disk.digest(scenario, sm, catalog, perf, sample) if disk is not None else ""
    stored = disk.read(digest, rows) if disk is not None else None
    if stored is not None:
        out = {phase: key_latency(library, sm.model, phase, rows[phase], share, sm.slo_attainment, cand)
               for phase, (share, cand) in stored.items()}
    else:
        shares = _model_shares(library, sm, catalog, perf, sample, rows[Phase.PREFILL], rows[Phase.DECODE])
        out = {phase: key_latency(library, sm.model, phase, rows[phase], shares[phase], sm.slo_attainment)
               for phase in Phase}
        if disk is not None:
            disk.write(digest, out)
    cache[key] = out
    return out


def _model_shares(library: TemplateLibrary, sm: ScenarioModel, catalog: Catalog, perf: RooflineModel,
                  sample: RequestSample, p_rows: np.ndarray, d_rows: np.ndarray) -> dict[Phase, np.ndarray]:
    """Each phase's share of the sampled requests within the SLO on templates `p_rows` and `d_rows`."""
    shape = perf.shape(catalog.model(sm.model))
    kv = np.asarray(shape.attended_tokens(sample.input_tokens.astype(float)), dtype=float) * shape.kv_bytes_per_token
    att = np.asarray(shape.attended_tokens(sample.input_tokens + sample.output_tokens / 2.0), dtype=float)
    nic = _nic_bytes_s(library, catalog)
    ttft_s, tpot_s = sm.prefill_slo_ms / 1e3, sm.decode_slo_ms / 1e3
    d_share, fastest = _decode_shares(library, d_rows, sample, kv, att, _decode_cycle_terms(
        library, catalog, perf, sm), nic, tpot_s)
    if not len(d_rows):
        fastest = np.zeros(len(kv))
    prompts = np.unique(sample.input_tokens)
    p_share = _prefill_shares(library, p_rows, sample, kv, _prefill_chunk_times(library, catalog, perf, sm, prompts),
                              prompts, nic, ttft_s, tpot_s, fastest)
    return {Phase.PREFILL: p_share, Phase.DECODE: d_share}


#: the code a rating depends on beyond its inputs: its source is part of the cache's digest (an edit recomputes)
_RATING_CODE = (latency_model, roofline, perf_model)


@dataclass(frozen=True)
class RatingCache:
    """Ratings of one library file, beside it (`<library>.latency.npz`): per model, each phase's shares and
    candidates under a digest of everything they depend on (the library's content, the model's scenario entry
    with its SLOs and target, its request sample, its architecture, the node configs, the perf model's
    parameters, `SAMPLE`, `ALLOWANCE_SHARE` and the rating code's source). A digest not in the file, a file
    that cannot be read, or entries that do not match the library's rows are recomputed (and the file
    rewritten, keeping only this library's entries); a folder that cannot be written is left as it is."""

    path: Path
    library: TemplateLibrary

    @classmethod
    def of(cls, library: TemplateLibrary) -> RatingCache | None:
        """The cache of a library loaded from (or saved to) a file; None for one made in memory."""
        return None if library.path is None else cls(library.path.with_suffix(".latency.npz"), library)

    def digest(self, scenario: Scenario, sm: ScenarioModel, catalog: Catalog, perf: RooflineModel,
               sample: RequestSample) -> str:
        parts = {
            "library": self.library.content_digest(),
            "model": model_key(scenario, sm),
            "sample": hashlib.blake2b(sample.input_tokens.tobytes() + sample.output_tokens.tobytes()).hexdigest(),
            "architecture": catalog.model(sm.model).model_dump(mode="json"),
            "nodes": [dataclasses.asdict(catalog.node_config(c)) for c in self.library.configs],
            "perf": perf.params.model_dump(mode="json"),
            "constants": [SAMPLE, ALLOWANCE_SHARE],
            "code": [hashlib.blake2b(Path(m.__file__ or "").read_bytes()).hexdigest() for m in _RATING_CODE],
        }
        return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()

    def _entries(self) -> dict[str, np.ndarray]:
        try:
            with np.load(self.path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
            return {}

    def read(self, digest: str, rows: dict[Phase, np.ndarray]) -> dict[Phase, tuple[np.ndarray, np.ndarray]] | None:
        """{phase: (shares, candidates)} stored under `digest` when they fit the library's `rows`, else None."""
        out = {}
        try:
            with np.load(self.path, allow_pickle=False) as data:
                for phase, r in rows.items():
                    share, cand = data[f"{digest}.{phase}.share"], data[f"{digest}.{phase}.candidates"]
                    if share.shape != r.shape or not np.isfinite(share).all() or not np.isin(cand, r).all():
                        return None
                    out[phase] = (share.astype(float), cand.astype(np.int64))
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
            return None
        return out

    def write(self, digest: str, ratings: dict[Phase, KeyLatency]) -> None:
        """Add one model's ratings, dropping entries of another library (atomically: a temporary file renamed
        over the cache)."""
        lib = np.array(self.library.content_digest())
        entries = self._entries()
        if entries.get("library") != lib:
            entries = {"library": lib}
        for phase, kl in ratings.items():
            entries[f"{digest}.{phase}.share"] = kl.share
            entries[f"{digest}.{phase}.candidates"] = kl.candidates
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=".coral-latency-", suffix=".npz", dir=self.path.parent)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **cast(dict[str, Any], entries))
            os.replace(tmp, self.path)
        except OSError:
            pass
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


@dataclass(frozen=True)
class LatencyBound:
    """A (model, phase) whose requests cannot meet the SLO at the model's target on any template, served alone."""

    model: str
    phase: Phase
    best_share: float
    floor: float

    def words(self) -> str:
        return (f"{self.model}/{self.phase.value} is latency-bound: on its best template only {self.best_share:.1%} "
                f"of its requests meet the SLO served alone (its instances need {self.floor:.1%} together); added "
                "capacity cannot help: relax its SLO, lower its target, or add faster GPU configs")


def scenario_latency(library: TemplateLibrary, scenario: Scenario, catalog: Catalog,
                     models: Sequence[str] | None = None) -> dict[tuple[str, Phase], KeyLatency]:
    """Every (model, phase) of the scenario (or of `models`) rated."""
    out: dict[tuple[str, Phase], KeyLatency] = {}
    for sm in scenario.models:
        if (models is not None and sm.model not in models) or sm.model not in catalog.models:
            continue  # no architecture to time it with (hand-made libraries): rated by throughput alone
        for phase, kl in model_latency(library, scenario, sm, catalog).items():
            out[(sm.model, phase)] = kl
    return out


def latency_bound(ratings: Sequence[KeyLatency]) -> list[LatencyBound]:
    """The latency-bound keys among `ratings`."""
    return [LatencyBound(kl.model, kl.phase, kl.best, kl.floor) for kl in ratings if len(kl.rows) and kl.bound]
