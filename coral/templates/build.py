"""Build the Serving Template Library: enumerate node combinations and solve each one's optimal placement."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from coral.catalog.loader import Catalog, CoralInputError, NodeConfig, market_catalog
from coral.catalog.schema import ModelArch, Scenario
from coral.perf.model import Phase, Workload
from coral.perf.roofline import RooflineModel
from coral.templates.fingerprint import fingerprint
from coral.templates.library import Stage, TemplateLibrary, bottleneck, dominated_rows
from coral.templates.placement import coupled_rates, set_partitions, solve_node_sets

CHUNK = 8192
ChunkTask = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]
ChunkResult = tuple[np.ndarray, np.ndarray, np.ndarray]
StageFilter = Callable[[Sequence[Stage]], bool]


@dataclass(frozen=True)
class BuildJob:
    """One (model, phase) of a scenario with everything its templates depend on."""

    model: ModelArch
    phase: Phase
    slo_ms: float
    workload: Workload
    configs: tuple[NodeConfig, ...]
    n_max: int
    rho: float

    @property
    def key(self) -> str:
        return f"{self.model.name}/{self.phase}"


@dataclass
class JobResult:
    job: BuildJob
    candidates: int
    node_sets: np.ndarray  # (M, n_max) config indices into job.configs, -1 padded
    sizes: np.ndarray
    throughput: np.ndarray
    partition: np.ndarray
    layers: np.ndarray
    tables: np.ndarray
    seconds: float
    step_fit: np.ndarray | None = None  # (3, S_max, C, L+1): planned micro-batch, step intercept, step slope


def profile_tables(perf: RooflineModel, job: BuildJob) -> tuple[np.ndarray, np.ndarray]:
    """(S_max, C, L+1) node throughput for j layers under budget SLO/S, S = 1..n_max, and (3, S_max, C, L+1)
    the planned micro-batch with a secant fit of step time around it (intercept s, slope s per batch unit)."""
    n_layers = job.model.num_hidden_layers
    j = np.arange(n_layers + 1)
    out = np.zeros((job.n_max, len(job.configs), n_layers + 1))
    step = np.zeros((3, *out.shape))
    for s in range(1, job.n_max + 1):
        for c, node in enumerate(job.configs):
            thr, batch = perf.throughput_table(job.model, job.phase, node, job.slo_ms / 1e3, s, job.workload)
            out[s - 1, c] = thr
            full = np.where(thr > 0, batch / np.where(thr > 0, thr, 1.0), 0.0)
            half = perf.step_time(job.model, job.phase, node, j, np.maximum(batch / 2, 1e-9), job.workload, s > 1)
            slope = np.where(batch > 0, (full - half) / np.maximum(batch / 2, 1e-9), 0.0)
            step[:, s - 1, c] = batch, full - slope * batch, slope
    return out, step


def candidate_node_sets(perf: RooflineModel, job: BuildJob) -> tuple[np.ndarray, np.ndarray]:
    """Node multisets with <= n_max nodes whose memory is <= rho x model size and whose nodes together can
    hold all layers. Rows are sorted config indices, padded with -1."""
    model_gb = perf.shape(job.model).model_bytes / 1e9
    mem = np.array([c.memory_gb for c in job.configs])
    fit = np.array([perf.max_layers(job.model, c, job.workload) for c in job.configs])
    usable = [i for i in range(len(job.configs)) if fit[i] > 0]
    rows: list[tuple[int, ...]] = []
    for k in range(1, job.n_max + 1):
        rows.extend(itertools.combinations_with_replacement(usable, k))
    if not rows:
        return np.zeros((0, job.n_max), dtype=np.int64), np.zeros(0, dtype=np.int64)
    sets = np.full((len(rows), job.n_max), -1, dtype=np.int64)
    sizes = np.array([len(r) for r in rows], dtype=np.int64)
    for k in range(1, job.n_max + 1):
        sel = sizes == k
        if sel.any():
            sets[sel, :k] = np.array([r for r in rows if len(r) == k], dtype=np.int64)
    padded = np.where(sets >= 0, sets, 0)
    valid = sets >= 0
    total_mem = np.where(valid, mem[padded], 0.0).sum(axis=1)
    total_layers = np.where(valid, fit[padded], 0).sum(axis=1)
    keep = (total_mem <= job.rho * model_gb + 1e-9) & (total_layers >= job.model.num_hidden_layers)
    return sets[keep], sizes[keep]


def prepare_job(job: BuildJob, perf: RooflineModel) -> JobResult:
    """Profile tables and candidate node sets of one (model, phase), not yet solved."""
    t0 = time.perf_counter()
    tables, step_fit = profile_tables(perf, job)
    sets, sizes = candidate_node_sets(perf, job)
    m = len(sets)
    return JobResult(
        job, m, sets, sizes, np.zeros(m), np.full(m, -1, dtype=np.int32),
        np.zeros((m, job.n_max), dtype=np.int32), tables, time.perf_counter() - t0, step_fit,
    )


def _solve_chunk(args: ChunkTask) -> ChunkResult:
    sets, sizes, tables, step_fit = args
    return solve_node_sets(np.where(sets >= 0, sets, 0), sizes, tables, step_fit)


def layout_columns(result: JobResult) -> dict[str, np.ndarray]:
    """Per-node stage, per-node throughput and per-stage layers of every solved node set."""
    m, width = result.node_sets.shape
    node_stage = np.zeros((m, width), dtype=np.int8)
    for n in np.unique(result.sizes):
        rows = np.flatnonzero((result.sizes == n) & (result.partition >= 0))
        labels, _ = set_partitions(int(n))
        node_stage[rows, :n] = labels[result.partition[rows]]
    n_stages = node_stage.max(axis=1) + 1
    valid = result.node_sets >= 0
    stage_layers = np.where(np.arange(width)[None, :] < n_stages[:, None], result.layers, 0).astype(np.int16)
    node_layers = np.take_along_axis(stage_layers, node_stage.astype(np.int64), axis=1)
    s_idx = np.broadcast_to((n_stages - 1)[:, None], (m, width))
    thr = result.tables[s_idx, np.where(valid, result.node_sets, 0), node_layers]
    return {
        "nodes": result.node_sets.astype(np.int16),
        "node_stage": np.where(valid, node_stage, 0).astype(np.int8),
        "node_throughput": np.where(valid, thr, 0.0),
        "stage_layers": stage_layers,
    }


def pipeline_node_throughput(result: JobResult, cols: dict[str, np.ndarray]) -> np.ndarray:
    """Per-node tokens/s a multi-stage placement really sustains (single-stage rows are unchanged): the template's
    shared-cycle rate (`coupled_rate`) split over each stage's nodes in proportion to their table throughput."""
    thr = cols["node_throughput"]
    if result.step_fit is None:
        return thr
    valid = result.node_sets >= 0
    n_stages = cols["node_stage"].max(axis=1) + 1
    rate = coupled_rates(
        np.where(valid, result.node_sets, 0), result.sizes, cols["node_stage"],
        cols["stage_layers"].astype(np.int32), result.tables, result.step_fit,
    )
    stage_sum = np.zeros_like(thr)
    for s in range(thr.shape[1]):
        in_s = (cols["node_stage"] == s) & valid
        stage_sum = np.where(in_s, np.where(in_s, thr, 0.0).sum(axis=1, keepdims=True), stage_sum)
    share = np.where(stage_sum > 0, thr / np.where(stage_sum > 0, stage_sum, 1.0), 0.0)
    return np.where((n_stages > 1)[:, None], rate[:, None] * share, thr)


def scenario_jobs(scenario: Scenario, catalog: Catalog, models: Sequence[str] | None = None) -> list[BuildJob]:
    configs = tuple(catalog.node_config(c) for c in scenario.configs)
    jobs = []
    for sm in scenario.models:
        if models and sm.model not in models:
            continue
        arch = catalog.model(sm.model)
        workload = Workload(sm.mean_input_tokens, sm.mean_output_tokens)
        for phase, slo in ((Phase.PREFILL, sm.prefill_slo_ms), (Phase.DECODE, sm.decode_slo_ms)):
            jobs.append(BuildJob(arch, phase, slo, workload, configs, scenario.n_max, scenario.rho))
    return jobs


def run_jobs(
    jobs: Sequence[BuildJob],
    perf: RooflineModel,
    workers: int | None = None,
    use_ray: bool = False,
    on_chunk: Callable[[int, int], None] | None = None,
    coupled: bool = True,
) -> list[JobResult]:
    """Solve all jobs, split in chunks, in this process, on local processes or on a Ray cluster. Placements
    maximise the shared-cycle rating (`coupled_rate`), or with `coupled=False` the paper's slowest-stage table
    throughput (re-rated afterwards by `results_to_library`)."""
    prepared = [prepare_job(job, perf) for job in jobs]
    tasks, owners = [], []
    for r in prepared:
        for a in range(0, r.candidates, CHUNK):
            b = min(a + CHUNK, r.candidates)
            tasks.append((r.node_sets[a:b], r.sizes[a:b], r.tables, r.step_fit if coupled else None))
            owners.append((r, a, b))
    if on_chunk:
        on_chunk(0, len(tasks))
    t0 = time.perf_counter()
    for i, out in enumerate(_map(tasks, workers, use_ray)):
        r, a, b = owners[i]
        r.throughput[a:b], r.partition[a:b], r.layers[a:b] = out
        if on_chunk:
            on_chunk(i + 1, len(tasks))
    spent = time.perf_counter() - t0
    total = sum(r.candidates for r in prepared) or 1
    for r in prepared:
        r.seconds += spent * r.candidates / total
    return prepared


def _map(tasks: list[ChunkTask], workers: int | None, use_ray: bool) -> Iterator[ChunkResult]:
    """Results of _solve_chunk over tasks, in task order."""
    if use_ray:
        yield from _map_on_ray(tasks)
    elif (workers or 1) <= 1 or len(tasks) <= 1:
        yield from map(_solve_chunk, tasks)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            yield from pool.map(_solve_chunk, tasks)


def _map_on_ray(tasks: list[ChunkTask]) -> Iterator[ChunkResult]:
    try:
        import ray
    except ImportError as exc:
        raise CoralInputError("--ray needs the ray extra: pip install 'coral[ray]'") from exc
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(_solve_chunk)
    refs = [remote.remote(t) for t in tasks]
    for ref in refs:
        yield ray.get(ref)


def results_to_library(
    results: Sequence[JobResult], configs: Sequence[str], meta: dict[str, str], stage_filter: StageFilter | None = None
) -> tuple[TemplateLibrary, dict[str, dict[str, int]]]:
    """Assemble one library from solved jobs, keeping node sets with positive throughput in which every node
    contributes (a node that adds nothing makes its set strictly dominated by the set without it, which is
    enumerated too); also return per-job counts."""
    cfg_index = np.array([list(configs).index(c.name) for c in results[0].job.configs] if results else [], dtype=np.int64)
    parts: list[dict[str, np.ndarray]] = []
    stats: dict[str, dict[str, int]] = {}
    for r in results:
        cols = layout_columns(r)
        cols["node_throughput"] = pipeline_node_throughput(r, cols)
        valid = r.node_sets >= 0
        useful = (r.throughput > 0) & ((cols["node_throughput"] > 0) | ~valid).all(axis=1)
        rows = np.flatnonzero(useful)
        nodes = np.where(valid[rows], cfg_index[np.where(valid[rows], r.node_sets[rows], 0)], -1)
        counts = np.zeros((len(rows), len(configs)), dtype=np.int16)
        for slot in range(nodes.shape[1]):
            has = nodes[:, slot] >= 0
            np.add.at(counts, (np.flatnonzero(has), nodes[has, slot]), 1)
        part = {k: v[rows] for k, v in cols.items()}
        part["nodes"] = nodes.astype(np.int16)
        part["counts"] = counts
        part["throughput"] = bottleneck(part["node_stage"], part["node_throughput"], part["stage_layers"])
        part["model"] = np.full(len(rows), r.job.model.name, dtype=object)
        part["phase"] = np.full(len(rows), str(r.job.phase), dtype=object)
        part["slo_ms"] = np.full(len(rows), r.job.slo_ms)
        parts.append(part)
        stats[r.job.key] = {"candidates": r.candidates, "feasible": int((r.throughput > 0).sum()), "kept": len(rows)}
    names = ("model", "phase", "slo_ms", "throughput", "counts", "nodes", "node_stage", "node_throughput",
             "stage_layers")
    width = max((p["nodes"].shape[1] for p in parts), default=1)
    cols_all: dict[str, np.ndarray] = {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in names}
    if not parts:
        cols_all.update(counts=np.zeros((0, len(configs)), dtype=np.int16),
                        nodes=np.zeros((0, width), dtype=np.int16), node_stage=np.zeros((0, width), dtype=np.int8),
                        node_throughput=np.zeros((0, width)), stage_layers=np.zeros((0, width), dtype=np.int16),
                        model=np.zeros(0, dtype=object), phase=np.zeros(0, dtype=object))
    cols_all["dominated"] = np.zeros(len(cols_all["throughput"]), dtype=bool)
    lib = TemplateLibrary(configs=list(configs), meta=dict(meta), **cols_all)  # type: ignore[arg-type]
    if stage_filter is not None:
        keep = np.array([stage_filter(lib.layout(i)) for i in range(len(lib))], dtype=bool)
        lib = lib.subset(np.flatnonzero(keep))
        for key in stats:
            stats[key]["kept"] = int(((lib.model == key.split("/")[0]) & (lib.phase == key.split("/")[1])).sum())
    lib.dominated = dominated_rows(lib)
    return lib, stats


def build_library(
    scenario: Scenario,
    catalog: Catalog | None = None,
    perf: RooflineModel | None = None,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    use_ray: bool = False,
    models: Sequence[str] | None = None,
    stage_filter: StageFilter | None = None,
) -> TemplateLibrary:
    """All templates of every (model, phase) of `scenario`; `progress(done, total)` is called as the placement
    jobs finish. Raises CoralInputError for a model that fits on no allowed node combination."""
    catalog = catalog or market_catalog(scenario)
    perf = perf or RooflineModel()
    jobs = scenario_jobs(scenario, catalog, models)
    t0 = time.perf_counter()
    results = run_jobs(jobs, perf, workers, use_ray, progress)
    meta = {
        "scenario": scenario.name,
        "n_max": str(scenario.n_max),
        "rho": str(scenario.rho),
        "perf_params": perf.params.model_dump_json(),
        "build_seconds": f"{time.perf_counter() - t0:.3f}",
        "filter": "custom" if stage_filter else "none",
        "prices": json.dumps({r: catalog.prices(r) for r in scenario.regions}),
        "fingerprint": json.dumps(fingerprint(scenario, catalog, perf, models)),
        "perf_source": "default" if perf.params == RooflineModel().params else "custom",
    }
    lib, stats = results_to_library(results, scenario.configs, meta, stage_filter)
    _check_every_job_served(jobs, stats)
    lib.meta["stats"] = json.dumps(stats)
    return lib


def _check_every_job_served(jobs: Sequence[BuildJob], stats: dict[str, dict[str, int]]) -> None:
    empty = [j for j in jobs if stats.get(j.key, {}).get("kept", 0) == 0]
    if empty:
        names = ", ".join(f"{j.key} (SLO {j.slo_ms:g} ms)" for j in empty)
        raise CoralInputError(
            f"no node combination of <= {jobs[0].n_max} nodes serves {names} within its SLO; "
            "raise n_max or rho, relax the SLO, or add larger GPU configs"
        )
