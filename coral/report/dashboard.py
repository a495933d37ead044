"""The live dashboard: the report page served by the gateway/controller, re-rendered from a polled JSON view.

    app.include_router(make_router(lambda: {"plan": plan.model_dump(mode="json"), "instances": [...],
                                            "latency": {...}}))

`/dashboard` serves the page (same template and renderer as `coral report`); its script polls
`/dashboard/state.json` (the view model of the current state) and redraws without a reload. Each poll also
adds a point to rolling time series (request rate, requests in flight, p99 TTFT / TPOT against the SLOs).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from coral.allocation.plan import Plan, SolveReport
from coral.catalog.loader import CoralInputError, validate
from coral.report.html import render_page
from coral.report.inputs import ReportInputs
from coral.report.view import view_model

DEFAULT_INTERVAL_MS = 2000


def _empty_view(error: str, instances: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The view of an empty plan (runtime not planned yet, or its plan failed to validate), with a note."""
    empty = Plan(
        scenario="–",
        method="–",
        instances=[],
        serving=[],
        cost_per_hour=0.0,
        solve=SolveReport(status="no plan"),
    )
    vm = view_model(empty, live=instances)
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
        summary = {k: raw[k] for k in ("scenario", "method", "cost_per_hour", "serving", "mode") if k in raw}
        try:
            plan = validate(Plan, {**summary, "instances": [], "solve": {"status": "summary"}}, "state.plan")
        except CoralInputError as exc:
            return None, str(exc)
        return plan, "the state carries a plan summary only; publish the full plan JSON to draw the instances"
    try:
        return validate(Plan, raw, "state.plan"), None
    except CoralInputError as exc:
        return None, str(exc)


def live_view(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """View model of a runtime state {"plan", "instances", "latency", "epochs"}; every key optional.

    `plan` is a Plan JSON (or a summary {scenario, method, cost_per_hour, serving}); `latency` maps a model to
    samples/CDF points (see coral.report.inputs) or to percentile numbers ({"p50_ms": .., ...}), shown as a table.
    Malformed parts become a note on the page instead of an error, so the dashboard keeps refreshing.
    """
    state = state if isinstance(state, Mapping) else {}
    instances = state.get("instances") or []
    instances = [r for r in instances if isinstance(r, Mapping)] if isinstance(instances, list) else []
    series, summary = _split_latency(state.get("latency"))
    notes: list[str] = []
    try:
        inputs = validate(ReportInputs, {"latency": series, "epochs": state.get("epochs") or []}, "state")
    except CoralInputError as exc:
        notes.append(str(exc))
        inputs = ReportInputs()
    plan, why = _plan_of(state.get("plan"))
    if plan is None:
        vm = _empty_view(why or "no plan", instances)
    else:
        vm = view_model(plan, sim=inputs, live=instances)
        vm["title"] = f"Coral dashboard — {plan.scenario} ({plan.method})"
        if plan.solve.status == "summary":
            vm["notes"] = []  # the instance-cost mismatch note is expected for a summary
        vm["notes"] = notes + ([why] if why else []) + vm["notes"]
    vm["live"]["latency_summary"] = summary
    return vm


class LiveHistory:
    """Rolling per-model series of the live state, one point per poll (the newest `keep`): request rate (from
    the growth of the instances' request counters), requests in flight, and p99 TTFT / TPOT when the latency
    summary has them (`ttft_p99_ms`, `tpot_p99_ms`)."""

    def __init__(self, keep: int = 300, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0: float | None = None
        self.points: deque[tuple[float, dict[str, dict[str, float]]]] = deque(maxlen=keep)
        self.lock = threading.Lock()

    def record(self, vm: Mapping[str, Any]) -> dict[str, Any] | None:
        """Add the view's state as a point; return the series in the report's `timeseries` shape."""
        live = vm.get("live") or {}
        per: dict[str, dict[str, float]] = {}
        for r in live.get("instances", []):
            m = per.setdefault(r["model"], {"requests": 0.0, "inflight": 0.0})
            m["requests"] += r["requests"]
            m["inflight"] += r["inflight"]
        for row in live.get("latency_summary", []):
            for key in ("ttft_p99_ms", "tpot_p99_ms"):
                if key in row and row["model"] in per:
                    per[row["model"]][key] = float(row[key])
        with self.lock:
            now = self.clock()
            self.t0 = now if self.t0 is None else self.t0
            self.points.append((now - self.t0, per))
            return self._series()

    def _series(self) -> dict[str, Any] | None:
        if not self.points:
            return None
        models = sorted({m for _, per in self.points for m in per})
        out: dict[str, Any] = {"bin_s": 0.0, "queue_label": "Requests in flight",
                               "rate": {}, "queue": {}, "ttft_p99_ms": {}, "tpot_p99_ms": {}}
        pts = list(self.points)
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
    state_provider: Callable[[], Mapping[str, Any] | None], *, interval_ms: int = DEFAULT_INTERVAL_MS
) -> APIRouter:
    """Router with GET /dashboard (HTML page) and GET /dashboard/state.json (the current view model)."""
    router = APIRouter()
    history = LiveHistory()

    def current() -> dict[str, Any]:
        try:
            vm = live_view(state_provider())
        except Exception as exc:  # the provider belongs to the runtime; show its failure, keep serving
            return _empty_view(f"state provider failed: {type(exc).__name__}: {exc}", [])
        vm["timeseries"] = history.record(vm)
        return vm

    @router.get("/dashboard/state.json", name="coral_dashboard_state")
    def dashboard_state() -> JSONResponse:
        return JSONResponse(current(), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard", response_class=HTMLResponse, name="coral_dashboard")
    def dashboard(request: Request) -> HTMLResponse:
        poll = request.url_for("coral_dashboard_state").path
        return HTMLResponse(render_page(current(), {"poll_url": poll, "interval_ms": interval_ms}))

    return router
