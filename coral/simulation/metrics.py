"""Simulation results: latency distributions, SLO attainment, goodput, cost over time, GPU utilisation;
saved as JSON and drawn as PNG plots."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from coral.simulation.engine import Engine, Instance, Record, Trace, nodes_beyond

CDF_POINTS = 101


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LatencyStats(_Result):
    """Milliseconds; `cdf[i]` is the i-th percentile (0..100) for plotting."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    cdf: list[float] = Field(default_factory=list)

    @classmethod
    def of(cls, values_s: np.ndarray) -> LatencyStats:
        v = np.sort(values_s[np.isfinite(values_s)] * 1e3)  # sorted once: the 104 percentiles then cost nothing
        if not len(v):
            return cls()
        q = np.percentile(v, [*np.linspace(0, 100, CDF_POINTS), 50, 90, 99])
        return cls(
            count=len(v), mean=float(v.mean()), p50=float(q[-3]), p90=float(q[-2]), p99=float(q[-1]),
            max=float(v.max()), cdf=[round(float(x), 4) for x in q[:-3]],
        )


class ModelMetrics(_Result):
    model: str
    ttft_slo_ms: float | None = Field(default=None, description="None for the aggregate")
    tpot_slo_ms: float | None = None
    requests: int
    finished: int
    refused: int = Field(default=0, description="shed at arrival (coral.allocation.shedding); never finished")
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats = Field(description="over requests generating >= 2 tokens")
    decode_wait_ms: LatencyStats = Field(description="first token to decode admission (KV room and a slot)")
    ttft_attainment: float = Field(description="share of requests with TTFT within the prefill SLO")
    tpot_attainment: float = Field(description="share of requests with mean TPOT within the decode SLO")
    slo_attainment: float = Field(description="share of requests meeting both SLOs (unfinished ones fail)")
    goodput_tokens_s: float = Field(description="generated tokens/s of requests meeting both SLOs")
    output_tokens_s: float = Field(description="generated tokens/s of finished requests")
    prefill_gpu_util: float = Field(description="busy share of ready prefill GPU time")
    decode_gpu_util: float = Field(description="busy share of ready decode GPU time")
    decode_batch_fill: float = Field(description="mean resident sequences / batch cap over ready decode node time")


class EpochMetrics(_Result):
    epoch: int
    start_s: float
    end_s: float
    cost_per_hour: float = Field(description="mean provisioning $/h over the epoch (starting and draining included)")
    goodput_tokens_s: float = Field(description="of requests arriving in the epoch")
    slo_attainment: float
    requests: int
    instances_ready: int = Field(description="at the epoch's start, after re-planning")
    instances_starting: int
    instances_draining: int
    over_availability: list[str] = Field(
        default_factory=list, description="'region:config used > available' at the epoch's start, if any"
    )


class InstanceRecord(_Result):
    """Life of one instance in the run (times in simulated seconds; inf = never)."""

    id: str
    model: str
    phase: str
    region: str
    n_nodes: int
    cost_per_hour: float
    start_s: float
    ready_s: float
    drain_s: float | None
    stop_s: float
    served: int = Field(description="requests it took")


class SimResult(_Result):
    schema_version: Literal[1] = 1
    scenario: str
    router: str
    seed: int
    duration_s: float
    end_s: float = Field(description="simulated time when the last request finished (or the drain limit hit)")
    epoch_s: float
    startup_delay_s: float
    requests: int
    finished: int
    unfinished: int = Field(description="admitted, not finished within the drain limit")
    refused: int = Field(default=0, description="shed at arrival: beyond the capacity serving their model")
    wall_s: float = 0.0
    requests_per_wall_s: float = 0.0
    mean_cost_per_hour: float
    total_cost: float = Field(description="$ over [0, duration]")
    goodput_tokens_s: float
    slo_attainment: float
    gpu_utilisation: float
    overall: ModelMetrics
    models: list[ModelMetrics]
    epochs: list[EpochMetrics]
    cost_timeline: list[tuple[float, float]] = Field(description="(time s, $/h from then on) change points")
    instances: list[InstanceRecord] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    plan_fingerprint: str = Field(
        default="", description="fingerprint of the plan run (coral.report.view.plan_fingerprint); '' if unknown"
    )
    _per_request: dict[str, np.ndarray] = PrivateAttr(default_factory=dict)

    def per_request(self) -> dict[str, np.ndarray]:
        """Per-request arrays of this run (arrival, model index, tokens, first-token and done times, how many
        times each finished); not saved in the JSON."""
        return self._per_request

    def save_requests_csv(self, path: str | Path) -> Path:
        """One row per request: model, arrival, tokens, TTFT, TPOT, decode wait, SLO met (times in s)."""
        pr = self._per_request
        names = [m.model for m in self.models]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["model", "arrival_s", "input_tokens", "output_tokens", "ttft_s", "tpot_s",
                        "decode_wait_s", "done_s", "slo_met"])
            cols = [pr["arrival_s"], pr["input_tokens"], pr["output_tokens"], pr["ttft_s"], pr["tpot_s"],
                    pr["decode_admit_s"] - pr["first_token_s"], pr["done_s"]]
            for k, m in enumerate(pr["model"].tolist()):
                a, i, o, ttft, tpot, wait, done = (c[k] for c in cols)
                w.writerow([names[m], f"{a:.6f}", int(i), int(o), f"{ttft:.6f}", f"{tpot:.6f}", f"{wait:.6f}",
                            f"{done:.6f}", int(pr["good"][k])])
        return path

    def model(self, name: str) -> ModelMetrics:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(name)

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load_json(cls, path: str | Path) -> SimResult:
        from coral.catalog.loader import load_file

        return load_file(cls, path)

    def plots(self, folder: str | Path) -> list[Path]:
        """latency_cdf.png (TTFT and TPOT CDFs per model) and epochs.png (cost and goodput per epoch)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        pct = np.linspace(0, 1, CDF_POINTS)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, attr, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "mean TPOT (ms)")):
            for m in self.models:
                stats: LatencyStats = getattr(m, attr)
                slo = m.ttft_slo_ms if attr == "ttft_ms" else m.tpot_slo_ms
                if stats.cdf:
                    (line,) = ax.plot(np.maximum(stats.cdf, 1e-3), pct, label=m.model)
                    if slo:
                        ax.axvline(slo, color=line.get_color(), linestyle=":", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests (dotted: SLO)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{self.scenario}: latency CDFs ({self.router} router)")
        fig.tight_layout()
        cdf_path = folder / "latency_cdf.png"
        fig.savefig(cdf_path, dpi=110)
        plt.close(fig)

        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
        if self.cost_timeline:
            ts = [t for t, _ in self.cost_timeline] + [self.duration_s]
            cs = [c for _, c in self.cost_timeline]
            ax.step(ts, [*cs, cs[-1]], where="post", color="#34495e", label="$/h over time")
        for e in self.epochs:
            ax.hlines(e.cost_per_hour, e.start_s, e.end_s, colors="#2e86c1", linewidth=3)
            ax2.bar((e.start_s + e.end_s) / 2, e.goodput_tokens_s, width=(e.end_s - e.start_s) * 0.9,
                    color="#c0392b", alpha=0.8)
            ax2.annotate(f"{e.slo_attainment:.0%}", ((e.start_s + e.end_s) / 2, e.goodput_tokens_s),
                         ha="center", va="bottom", fontsize=8)
        ax.plot([], [], color="#2e86c1", linewidth=3, label="epoch mean $/h")
        ax.set_ylabel("$/h")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        ax2.set_ylabel("goodput (tokens/s in SLO)")
        ax2.set_xlabel("simulated time (s); labels: SLO attainment of the epoch's requests")
        top = max((e.goodput_tokens_s for e in self.epochs), default=0.0)
        ax2.set_ylim(0, top * 1.2 or 1.0)
        ax2.grid(alpha=0.3)
        fig.suptitle(f"{self.scenario}: cost and goodput per epoch")
        fig.tight_layout()
        ep_path = folder / "epochs.png"
        fig.savefig(ep_path, dpi=110)
        plt.close(fig)
        return [cdf_path, ep_path]


def _cost_integral(instances: list[Instance], a: float, b: float) -> float:
    """$ spent on `instances` over [a, b]."""
    total = 0.0
    for i in instances:
        lo, hi = max(a, i.start_s), min(b, i.stop_s)
        if hi > lo:
            total += i.cost * (hi - lo) / 3600.0
    return total


def _cost_timeline(instances: list[Instance], end: float) -> list[tuple[float, float]]:
    deltas: dict[float, float] = {}
    for i in instances:
        if i.start_s < end:
            deltas[i.start_s] = deltas.get(i.start_s, 0.0) + i.cost
            if i.stop_s < end:
                deltas[i.stop_s] = deltas.get(i.stop_s, 0.0) - i.cost
    out, level = [], 0.0
    for t in sorted(deltas):
        level += deltas[t]
        out.append((round(t, 6), round(max(level, 0.0), 6)))
    return out


def _over(instances: list[Instance], t: float, avail: dict[str, dict[str, int]]) -> list[str]:
    """'region:config held > count' for the pairs whose nodes held at time t (starting, serving or draining)
    exceed `avail`."""
    held = (i for i in instances if i.start_s <= t < i.stop_s)
    return [f"{region}:{cfg} {n} > {cap}" for (region, cfg), (n, cap) in sorted(nodes_beyond(held, avail).items())]


def _batch_fill(instances: list[Instance], end: float, model: str | None) -> float:
    """Time-average of k / cap over the ready time of decode nodes (GPU-weighted)."""
    fill = alive = 0.0
    for inst in instances:
        if inst.phase != "decode" or (model is not None and inst.model != model):
            continue
        span = min(inst.stop_s, end) - inst.ready_s
        if span <= 0:
            continue
        for n in inst.all_nodes():
            fill += n.gpus * n.k_area / n.cap
            alive += n.gpus * span
    return fill / alive if alive else 0.0


def _utilisation(instances: list[Instance], end: float, model: str | None, phase: str | None) -> float:
    """GPU-weighted busy share of ready node time (None = any model / phase)."""
    busy = alive = 0.0
    for inst in instances:
        if (phase is not None and inst.phase != phase) or (model is not None and inst.model != model):
            continue
        span = min(inst.stop_s, end) - inst.ready_s
        if span <= 0:
            continue
        for n in inst.all_nodes():
            busy += n.gpus * min(n.busy_time, span)
            alive += n.gpus * span
    return busy / alive if alive else 0.0


def collect(
    engine: Engine,
    trace: Trace,
    record: Record,
    *,
    scenario: str,
    router: str,
    seed: int,
    duration_s: float,
    epoch_s: float,
    startup_delay_s: float,
    ttft_slo_s: np.ndarray,
    tpot_slo_s: np.ndarray,
    available: Callable[[float], dict[str, dict[str, int]]] | None = None,
) -> SimResult:
    """Turn one run's raw record into a SimResult. `*_slo_s` are per model index."""
    arr, mod, out = engine.arrival, engine.model_of, engine.out_array
    t_first, t_done = record.first_token_s, record.done_s
    done = record.done_count > 0
    refused = record.refused
    ttft = t_first - arr
    wait = record.decode_admit_s - t_first
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (t_done - t_first) / np.maximum(out - 1, 1), 0.0)
    tpot = np.where(done, tpot, np.nan)
    ttft_ok = np.nan_to_num(ttft, nan=np.inf) <= ttft_slo_s[mod] + 1e-9 if len(mod) else np.zeros(0, bool)
    tpot_ok = np.nan_to_num(tpot, nan=np.inf) <= tpot_slo_s[mod] + 1e-9 if len(mod) else np.zeros(0, bool)
    good = done & ttft_ok & tpot_ok
    end = trace.end_s
    insts = trace.instances

    def metrics(name: str, sel: np.ndarray, k: int | None) -> ModelMetrics:
        n = int(sel.sum())
        model = None if k is None else name
        return ModelMetrics(
            model=name,
            ttft_slo_ms=None if k is None else float(ttft_slo_s[k] * 1e3),
            tpot_slo_ms=None if k is None else float(tpot_slo_s[k] * 1e3),
            requests=n,
            finished=int((sel & done).sum()),
            refused=int((sel & refused).sum()),
            ttft_ms=LatencyStats.of(ttft[sel]),
            tpot_ms=LatencyStats.of(tpot[sel & (out > 1)]),
            decode_wait_ms=LatencyStats.of(wait[sel & (out > 1)]),
            ttft_attainment=float((sel & ttft_ok).sum() / n) if n else 0.0,
            tpot_attainment=float((sel & done & tpot_ok).sum() / n) if n else 0.0,
            slo_attainment=float((sel & good).sum() / n) if n else 0.0,
            goodput_tokens_s=float(out[sel & good].sum() / duration_s),
            output_tokens_s=float(out[sel & done].sum() / duration_s),
            prefill_gpu_util=_utilisation(insts, end, model, "prefill"),
            decode_gpu_util=_utilisation(insts, end, model, "decode"),
            decode_batch_fill=_batch_fill(insts, end, model),
        )

    models = [metrics(m, mod == i, i) for i, m in enumerate(engine.models)]
    overall = metrics("all", np.ones(len(mod), dtype=bool), None)
    epochs = []
    n_epochs = max(1, int(np.ceil(duration_s / epoch_s - 1e-9)))
    for e in range(n_epochs):
        a, b = e * epoch_s, min((e + 1) * epoch_s, duration_s)
        sel = (arr >= a) & (arr < b)
        n = int(sel.sum())
        epochs.append(EpochMetrics(
            epoch=e, start_s=a, end_s=b,
            cost_per_hour=_cost_integral(insts, a, b) * 3600.0 / (b - a),
            goodput_tokens_s=float(out[sel & good].sum() / (b - a)),
            slo_attainment=float((sel & good).sum() / n) if n else 0.0,
            requests=n,
            instances_ready=sum(1 for i in insts if i.ready_s <= a < min(i.drain_s, i.stop_s)),
            instances_starting=sum(1 for i in insts if i.start_s <= a < min(i.ready_s, i.stop_s)),
            instances_draining=sum(1 for i in insts if i.drain_s <= a < i.stop_s),
            over_availability=_over(insts, a, available(a)) if available is not None else [],
        ))
    total_cost = _cost_integral(insts, 0.0, duration_s)
    p_idx, d_idx = record.prefill_instance, record.decode_instance
    served = np.bincount(np.concatenate([p_idx[p_idx >= 0], d_idx[d_idx >= 0]]), minlength=len(insts))
    records = [
        InstanceRecord(
            id=i.spec.id, model=i.model, phase=i.phase, region=i.spec.region, n_nodes=i.spec.n_nodes,
            cost_per_hour=i.cost, start_s=i.start_s, ready_s=i.ready_s,
            drain_s=i.drain_s if np.isfinite(i.drain_s) else None, stop_s=i.stop_s, served=int(served[k]),
        )
        for k, i in enumerate(insts)
    ]
    result = SimResult(
        scenario=scenario, router=router, seed=seed, duration_s=duration_s, end_s=end, epoch_s=epoch_s,
        startup_delay_s=startup_delay_s, requests=len(arr), finished=int(done.sum()),
        unfinished=int((~done & ~refused).sum()), refused=int(refused.sum()), mean_cost_per_hour=total_cost * 3600.0 / duration_s, total_cost=total_cost,
        goodput_tokens_s=overall.goodput_tokens_s, slo_attainment=overall.slo_attainment,
        gpu_utilisation=_utilisation(insts, end, None, None),
        overall=overall, models=models, epochs=epochs, cost_timeline=_cost_timeline(insts, duration_s),
        instances=records,
    )
    result._per_request = {
        "arrival_s": arr, "model": mod, "input_tokens": engine.inp_array, "output_tokens": out,
        "first_token_s": t_first, "decode_admit_s": record.decode_admit_s, "done_s": t_done, "done_count": record.done_count,
        "ttft_s": ttft, "tpot_s": tpot, "good": good, "refused": refused, "prefill_instance": p_idx, "decode_instance": d_idx,
    }
    return result

