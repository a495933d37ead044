"""The live dashboard: the report page served by the gateway/controller, re-rendered from a polled JSON view.

    app.include_router(make_router(lambda: {"plan": plan.model_dump(mode="json"), "instances": [...],
                                            "latency": {...}}))

`/dashboard` serves the page (same template and renderer as `coral report`); its script polls
`/dashboard/state.json` (the view model of the current state) and redraws without a reload. While the app runs,
the router's lifespan samples the state every `sample_s` seconds into a ring buffer (the last `keep_s` kept):
request rate, requests in flight, p99 TTFT / TPOT against the SLOs, so a page opened late shows the history.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from itertools import pairwise
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from coral.allocation.plan import Plan, SolveReport
from coral.catalog.loader import CoralInputError, validate
from coral.report.html import render_page
from coral.report.inputs import ReportInputs
from coral.report.view import live_section, plan_title, view_model

DEFAULT_INTERVAL_MS = 2000
DEFAULT_SAMPLE_S = 5.0
DEFAULT_KEEP_S = 3600.0


def _empty_view(
    error: str, instances: list[Mapping[str, Any]], requests: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The view of an empty plan (runtime not planned yet, or its plan failed to validate), with a note."""
    empty = Plan(
        scenario="–",
        method="–",
        instances=[],
        serving=[],
        cost_per_hour=0.0,
        solve=SolveReport(status="no plan"),
    )
    vm = view_model(empty, live=instances, live_requests=requests)
    vm["title"] = "Coral dashboard — no plan"
    vm["notes"] = [error]
    return vm


def _split_latency(raw: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Latency per model -> (series with samples/CDF points, rows of percentile summaries like the gateway's)."""
    series: dict[str, Any] = {}
    summary: list[dict[str, Any]] = []
    if not isinstance(raw, Mapping):
        return series, summary
    for model, v in sorted(raw.items()):
        if not isinstance(v, Mapping):
            continue
        if "ttft_ms" in v or "tpot_ms" in v:
            series[model] = v
        else:
            nums = {k: x for k, x in v.items() if isinstance(x, int | float) and not isinstance(x, bool)}
            if nums:
                summary.append({"model": str(model), **nums})
    return series, summary


def _plan_of(raw: Any) -> tuple[Plan | None, str | None]:
    """A full Plan from the state, or None and why. A plan summary (no `instances`) is kept without diagrams."""
    if raw is None:
        return None, "no plan yet: the controller has not published one"
    if isinstance(raw, Plan):
        return raw, None
    if isinstance(raw, Mapping) and "instances" not in raw and "scenario" in raw:
        keys = ("scenario", "method", "cost_per_hour", "serving", "mode", "engine")
        summary = {k: raw[k] for k in keys if k in raw}
        try:
            plan = validate(Plan, {**summary, "instances": [], "solve": {"status": "summary"}}, "state.plan")
        except CoralInputError as exc:
            return None, str(exc)
        return plan, "the state carries a plan summary only; publish the full plan JSON to draw the instances"
    try:
        return validate(Plan, raw, "state.plan"), None
    except CoralInputError as exc:
        return None, str(exc)


def _live_parts(
    state: Mapping[str, Any],
) -> tuple[list[Mapping[str, Any]], dict[str, Any], list[dict[str, Any]], dict[str, float] | None]:
    """(instance rows, latency series, latency summary rows, client requests per model from the summary's
    `requests`, None when it has none) of a runtime state."""
    instances = state.get("instances") or []
    instances = [r for r in instances if isinstance(r, Mapping)] if isinstance(instances, list) else []
    series, summary = _split_latency(state.get("latency"))
    requests = {row["model"]: float(row["requests"]) for row in summary if "requests" in row}
    return instances, series, summary, requests or None


def live_numbers(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `live` part of `live_view` alone (instances, client requests, latency summary): what the history
    samples, without rendering the plan."""
    state = state if isinstance(state, Mapping) else {}
    instances, _, summary, requests = _live_parts(state)
    plan, _ = _plan_of(state.get("plan"))
    return {**live_section(plan, instances, requests), "latency_summary": summary}


def live_view(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """View model of a runtime state {"plan", "instances", "latency", "epochs"}; every key optional.

    `plan` is a Plan JSON (or a summary {scenario, method, cost_per_hour, serving}); `latency` maps a model to
    samples/CDF points (see coral.report.inputs) or to percentile numbers ({"requests": .., "p50_ms": .., ...},
    as `coral.runtime.gateway.Gateway.state` gives), shown as a table; its `requests` are the client requests.
    Malformed parts become a note on the page instead of an error, so the dashboard keeps refreshing.
    """
    state = state if isinstance(state, Mapping) else {}
    instances, series, summary, requests = _live_parts(state)
    notes: list[str] = []
    try:
        inputs = validate(ReportInputs, {"latency": series, "epochs": state.get("epochs") or []}, "state")
    except CoralInputError as exc:
        notes.append(str(exc))
        inputs = ReportInputs()
    plan, why = _plan_of(state.get("plan"))
    if plan is None:
        vm = _empty_view(why or "no plan", instances, requests)
    else:
        vm = view_model(plan, sim=inputs, live=instances, live_requests=requests)
        vm["title"] = plan_title(plan, "Coral dashboard")
        if plan.solve.status == "summary":
            vm["notes"] = []  # the instance-cost mismatch note is expected for a summary
        vm["notes"] = notes + ([why] if why else []) + vm["notes"]
    vm["live"]["latency_summary"] = summary
    return vm


class LiveHistory:
    """Ring buffer of per-model points sampled from the live state (the last `keep_s` seconds at one point per
    `sample_s`): client requests (the rate is their growth between points), requests in flight, and p99 TTFT /
    TPOT when the latency summary has them (`ttft_p99_ms`, `tpot_p99_ms`)."""

    def __init__(
        self, keep_s: float = DEFAULT_KEEP_S, sample_s: float = DEFAULT_SAMPLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.keep_s = keep_s
        self.t0: float | None = None
        self.points: deque[tuple[float, dict[str, dict[str, float]]]] = deque(maxlen=max(2, math.ceil(keep_s / sample_s)))
        self.lock = threading.Lock()

    def record(self, live: Mapping[str, Any]) -> None:
        """Add a point from a `live` section (`live_numbers`)."""
        per: dict[str, dict[str, float]] = {}
        for m, n in (live.get("requests_by_model") or {}).items():
            per.setdefault(m, {"requests": 0.0, "inflight": 0.0})["requests"] = float(n)
        for r in live.get("instances", []):
            per.setdefault(r["model"], {"requests": 0.0, "inflight": 0.0})["inflight"] += r["inflight"]
        for row in live.get("latency_summary", []):
            for key in ("ttft_p99_ms", "tpot_p99_ms"):
                if key in row and row["model"] in per:
                    per[row["model"]][key] = float(row[key])
        with self.lock:
            now = self.clock()
            self.t0 = now if self.t0 is None else self.t0
            self.points.append((now - self.t0, per))

    def series(self) -> dict[str, Any] | None:
        """The points in the report's `timeseries` shape (None before the first)."""
        with self.lock:
            pts = list(self.points)
        if not pts:
            return None
        models = sorted({m for _, per in pts for m in per})
        out: dict[str, Any] = {"bin_s": 0.0, "keep_s": self.keep_s, "queue_label": "Requests in flight",
                               "rate": {}, "queue": {}, "ttft_p99_ms": {}, "tpot_p99_ms": {}}
        for m in models:
            out["queue"][m] = [[t, per[m]["inflight"]] for t, per in pts if m in per]
            for key in ("ttft_p99_ms", "tpot_p99_ms"):
                out[key][m] = [[t, per[m][key]] for t, per in pts if key in per.get(m, {})]
            out["rate"][m] = [
                [t1, max(0.0, (b[m]["requests"] - a[m]["requests"]) / (t1 - t0))]
                for (t0, a), (t1, b) in pairwise(pts)
                if m in a and m in b and t1 > t0
            ]
        if len(pts) > 1:
            out["bin_s"] = (pts[-1][0] - pts[0][0]) / (len(pts) - 1)
        return out


def make_router(
    state_provider: Callable[[], Mapping[str, Any] | None],
    *,
    interval_ms: int = DEFAULT_INTERVAL_MS,
    sample_s: float = DEFAULT_SAMPLE_S,
    keep_s: float = DEFAULT_KEEP_S,
) -> APIRouter:
    """Router with GET /dashboard (HTML page) and GET /dashboard/state.json (the current view model, with the
    history); its lifespan samples the state every `sample_s` seconds while the app runs."""
    history = LiveHistory(keep_s, sample_s)

    def sample_loop(stop: threading.Event) -> None:
        while not stop.is_set():
            # a failing provider is shown on the page by `current`; the history just has no point then
            with contextlib.suppress(Exception):
                history.record(live_numbers(state_provider()))
            stop.wait(sample_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        sampler = threading.Thread(target=sample_loop, args=(stop,), name="coral-dashboard-history", daemon=True)
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            await run_in_threadpool(sampler.join, 10.0)

    router = APIRouter(lifespan=lifespan)

    def current() -> dict[str, Any]:
        try:
            vm = live_view(state_provider())
        except Exception as exc:  # the provider belongs to the runtime; show its failure, keep serving
            vm = _empty_view(f"state provider failed: {type(exc).__name__}: {exc}", [])
        vm["timeseries"] = history.series()
        return vm

    @router.get("/dashboard/state.json", name="coral_dashboard_state")
    def dashboard_state() -> JSONResponse:
        return JSONResponse(current(), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard", response_class=HTMLResponse, name="coral_dashboard")
    def dashboard(request: Request) -> HTMLResponse:
        poll = request.url_for("coral_dashboard_state").path
        return HTMLResponse(render_page(current(), {"poll_url": poll, "interval_ms": interval_ms}))

    return router
