"""Optional report inputs: per-epoch series and latency distributions, in a small tolerant model of our own.

The simulator and experiment runner map their results onto `ReportInputs` (schema_version 1):

    {"schema_version": 1,
     "epochs": [{"epoch": 0, "cost_per_hour": 12.5, "goodput": 830.0, "churn": 2, "method": "coral"}, ...],
     "latency": {"phi-4": {"ttft_ms": [...], "tpot_ms": [...], "slo_ttft_ms": 1200, "slo_tpot_ms": 60}}}

Latency series are either raw samples (any order) or CDF points `[[x_ms, p], ...]` with p in (0, 1].
Unknown keys are ignored, so a richer simulator output validates as long as these fields are well-formed.
`adapt_inputs` also accepts per-request records (`{"requests": [{"model", "ttft_ms", "tpot_ms"}, ...]}`);
`coral.report.adapters` maps the simulator's SimResult and reads files.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coral.catalog.loader import CoralInputError, validate

REPORT_INPUTS_SCHEMA_VERSION = 1
MAX_CDF_POINTS = 200


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EpochPoint(_Tolerant):
    """One reconfiguration epoch of an experiment (or of a simulated run)."""

    epoch: int = Field(ge=0)
    cost_per_hour: float = Field(ge=0, description="provisioning $/h during the epoch")
    goodput: float = Field(default=0.0, ge=0, description="SLO-meeting generated tokens/s")
    churn: float = Field(default=0.0, ge=0, description="instances started + stopped at the epoch boundary")
    method: str = Field(default="", description="series name; empty means the plan's method")


class LatencySeries(_Tolerant):
    """Latency distribution of one model: samples or CDF points, with optional SLOs (ms)."""

    ttft_ms: list[float] | list[tuple[float, float]] = Field(default_factory=list)
    tpot_ms: list[float] | list[tuple[float, float]] = Field(default_factory=list)
    slo_ttft_ms: float | None = Field(default=None, gt=0)
    slo_tpot_ms: float | None = Field(default=None, gt=0)
    count: int | None = Field(default=None, ge=0, description="requests behind the series (else its length)")
    ttft_attainment: float | None = Field(
        default=None, ge=0, le=1, description="exact share within the TTFT SLO"
    )
    tpot_attainment: float | None = Field(
        default=None, ge=0, le=1, description="exact share within the TPOT SLO"
    )
    slo_attainment: float | None = Field(
        default=None, ge=0, le=1, description="exact share meeting both SLOs (unfinished requests fail)"
    )

    @field_validator("ttft_ms", "tpot_ms")
    @classmethod
    def _valid_series(
        cls, v: list[float] | list[tuple[float, float]]
    ) -> list[float] | list[tuple[float, float]]:
        for item in v:
            if isinstance(item, tuple):
                if not 0 < item[1] <= 1:
                    raise ValueError(f"CDF point {list(item)} must have probability in (0, 1]")
                if item[0] < 0:
                    raise ValueError(f"CDF point {list(item)} has a negative latency")
            elif item < 0:
                raise ValueError(f"latency sample {item} is negative")
        return v


class MethodResult(_Tolerant):
    """A simulated run of one method's plan (Coral or a baseline), for the side-by-side SLO comparison."""

    method: str
    how: str = Field(default="", description="e.g. 'fixed plan' or 're-planned every epoch'")
    slo_attainment: float = Field(ge=0, le=1)
    goodput_tokens_s: float = Field(default=0.0, ge=0)
    cost_per_hour: float = Field(default=0.0, ge=0, description="mean simulated provisioning $/h")
    by_model: dict[str, float] = Field(default_factory=dict, description="SLO attainment per model")


class TimeSeries(_Tolerant):
    """Per-model series over simulated (or wall) time: arrival rate, latency of the requests arriving in each
    bin, and queue depth (requests arrived but not yet decoding) at each bin's end. None = no data."""

    t_s: list[float] = Field(default_factory=list, description="bin starts, s")
    bin_s: float = Field(default=60.0, gt=0)
    rate: dict[str, list[float | None]] = Field(default_factory=dict, description="requests/s")
    ttft_p99_ms: dict[str, list[float | None]] = Field(default_factory=dict)
    tpot_p99_ms: dict[str, list[float | None]] = Field(default_factory=dict)
    queue: dict[str, list[float | None]] = Field(default_factory=dict)


class ReportInputs(_Tolerant):
    """Everything beyond the plan that the report can show; every part optional."""

    schema_version: int = REPORT_INPUTS_SCHEMA_VERSION
    epochs: list[EpochPoint] = Field(default_factory=list)
    latency: dict[str, LatencySeries] = Field(default_factory=dict)
    overall_attainment: float | None = Field(default=None, ge=0, le=1, description="all models, both SLOs")
    methods: list[MethodResult] = Field(default_factory=list)
    timeseries: TimeSeries | None = None
    scenario: str = Field(default="", description="scenario the results belong to")
    plan_fingerprint: str = Field(default="", description="coral.report.view.plan_fingerprint of the plan run")
    run: str = Field(default="", description="which run the latency and time series are of, in words, with its cost "
                     "(e.g. the plan re-planned every 15 min, $68.98/h mean); shown beside them")

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != REPORT_INPUTS_SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema_version {v}; this Coral reads {REPORT_INPUTS_SCHEMA_VERSION}"
            )
        return v

    def merged(self, other: ReportInputs) -> ReportInputs:
        """Epochs and method runs of both; latency of `other` overrides per model, its other parts when set."""
        return ReportInputs(
            epochs=[*self.epochs, *other.epochs],
            latency={**self.latency, **other.latency},
            overall_attainment=(
                self.overall_attainment if other.overall_attainment is None else other.overall_attainment
            ),
            methods=[*self.methods, *other.methods],
            timeseries=other.timeseries or self.timeseries,
            scenario=other.scenario or self.scenario,
            plan_fingerprint=other.plan_fingerprint or self.plan_fingerprint,
            run=other.run or self.run,
        )


def _num(record: Mapping[str, Any], ms_key: str, s_key: str) -> float | None:
    if record.get(ms_key) is not None:
        return float(record[ms_key])
    if record.get(s_key) is not None:
        return 1000.0 * float(record[s_key])
    return None


def latency_from_requests(
    records: Iterable[Mapping[str, Any]], slos: Mapping[str, tuple[float | None, float | None]] | None = None
) -> dict[str, LatencySeries]:
    """Group per-request records ({model, ttft_ms|ttft_s, tpot_ms|tpot_s}) into latency series per model.

    `slos` maps model -> (ttft SLO ms, tpot SLO ms). Records without a model or a latency are skipped.
    """
    ttft: dict[str, list[float]] = {}
    tpot: dict[str, list[float]] = {}
    for rec in records:
        model = rec.get("model")
        if not model:
            continue
        ttft.setdefault(model, [])
        tpot.setdefault(model, [])
        if (t := _num(rec, "ttft_ms", "ttft_s")) is not None:
            ttft[model].append(t)
        if (t := _num(rec, "tpot_ms", "tpot_s")) is not None:
            tpot[model].append(t)
    slos = slos or {}
    return {
        m: LatencySeries(
            ttft_ms=ttft[m],
            tpot_ms=tpot[m],
            slo_ttft_ms=slos.get(m, (None, None))[0],
            slo_tpot_ms=slos.get(m, (None, None))[1],
        )
        for m in sorted(ttft)
    }


def adapt_inputs(
    data: ReportInputs | BaseModel | Mapping[str, Any] | None, source: str = "report inputs"
) -> ReportInputs:
    """Coerce a ReportInputs, any pydantic result with matching fields, or a dict into ReportInputs.

    A dict may carry `requests` (per-request records) instead of, or besides, `latency`; `slos` then gives
    {model: {"ttft_ms": .., "tpot_ms": ..}}.
    """
    if data is None:
        return ReportInputs()
    if isinstance(data, ReportInputs):
        return data
    raw: dict[str, Any] = dict(data.model_dump(mode="json") if isinstance(data, BaseModel) else data)
    requests = raw.pop("requests", None)
    if requests is not None and not isinstance(requests, list):
        raise CoralInputError(f"{source}: invalid input\n  requests: must be a list of per-request records")
    inputs = validate(ReportInputs, raw, source)
    if requests:
        slo_raw = raw.get("slos") or {}
        slos = {m: (s.get("ttft_ms"), s.get("tpot_ms")) for m, s in slo_raw.items() if isinstance(s, Mapping)}
        inputs = inputs.model_copy(
            update={"latency": {**latency_from_requests(requests, slos), **inputs.latency}}
        )
    return inputs


def cdf_points(
    series: list[float] | list[tuple[float, float]], max_points: int | None = None
) -> list[list[float]]:
    """Normalise samples or CDF points to sorted [x, p] steps (p = fraction <= x), thinned to `max_points`."""
    if not series:
        return []
    if isinstance(series[0], tuple):
        pts = sorted((float(x), float(p)) for x, p in series)
        # a CDF is non-decreasing: repair noisy inputs instead of drawing a line that goes back down
        out: list[list[float]] = []
        best = 0.0
        for x, p in pts:
            best = max(best, p)
            out.append([x, best])
        return _thin(out, max_points)
    xs = sorted(float(x) for x in series)
    n = len(xs)
    return _thin([[x, (i + 1) / n] for i, x in enumerate(xs)], max_points)


def _thin(points: list[list[float]], max_points: int | None) -> list[list[float]]:
    if max_points is None or len(points) <= max_points:
        return points
    step = (len(points) - 1) / (max_points - 1)
    return [points[round(k * step)] for k in range(max_points)]


def cdf_at(points: list[list[float]], x: float) -> float:
    """Fraction of the distribution at or below `x` (the step CDF's value)."""
    i = bisect.bisect_right([p[0] for p in points], x)
    return points[i - 1][1] if i else 0.0


def quantile(points: list[list[float]], q: float) -> float | None:
    """Smallest x whose CDF reaches q (None for an empty series)."""
    for x, p in points:
        if p >= q - 1e-12:
            return x
    return points[-1][0] if points else None
