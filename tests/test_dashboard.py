"""The live dashboard router: JSON state, tolerance to partial state, and live re-rendering in Chromium."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from coral.report.browser import chromium_binary, run_chromium
from coral.report.dashboard import live_view, make_router
from coral.report.examples import example_inputs, example_plan

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


class CountingState:
    """A runtime stand-in whose instances gain one in-flight request per poll."""

    def __init__(self) -> None:
        self.plan = example_plan()
        self.latency: dict[str, Any] = {m: s.model_dump() for m, s in example_inputs(n=60).latency.items()}
        self.latency["gateway-only"] = {"count": 5, "p50_ms": 120.0, "p99_ms": 480.0}  # percentile form
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self.lock:
            self.calls += 1
            n = self.calls
        return {
            "plan": self.plan.model_dump(mode="json"),
            "instances": [
                {
                    "id": i.id,
                    "state": "starting" if k == 0 else "ready",
                    "inflight": n,
                    "requests": 10 * n,
                    "weight": i.throughput,
                }
                for k, i in enumerate(self.plan.instances)
            ],
            "latency": self.latency,
        }


def client(provider: Any) -> TestClient:
    app = FastAPI()
    app.include_router(make_router(provider, interval_ms=300))
    return TestClient(app)


def test_state_json_and_page() -> None:
    state = CountingState()
    c = client(state)
    vm = c.get("/dashboard/state.json").json()
    assert vm["summary"]["cost_per_hour"] == pytest.approx(state.plan.cost_per_hour)
    assert vm["live"]["states"] == {"ready": 8, "starting": 1}
    assert vm["live"]["total_inflight"] == 9  # 9 instances x 1 in flight on the first poll
    assert len(vm["latency"]) == 6
    page = c.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '"poll_url":"/dashboard/state.json"' in page.text and '"interval_ms":300' in page.text


@pytest.mark.parametrize(
    ("state", "note"),
    [
        ({}, "no plan yet"),
        (None, "no plan yet"),
        ({"plan": {"scenario": "core"}, "instances": [{"id": "a", "state": "ready"}]}, "state.plan"),
        ({"plan": None, "instances": "not a list"}, "no plan yet"),
    ],
)
def test_partial_or_bad_state_still_renders(state: Any, note: str) -> None:
    vm = client(lambda: state).get("/dashboard/state.json").json()
    assert note in vm["notes"][0]
    assert vm["summary"]["n_instances"] == 0


def test_bad_latency_becomes_a_note_but_plan_renders() -> None:
    vm = live_view({"plan": example_plan().model_dump(mode="json"), "latency": {"m": {"ttft_ms": [-1]}}})
    assert "latency.m.ttft_ms" in vm["notes"][0]
    assert vm["summary"]["n_instances"] == 9 and vm["live"]["instances"] == []


def test_failing_provider_is_reported_not_raised() -> None:
    def boom() -> dict[str, Any]:
        raise RuntimeError("controller down")

    c = client(boom)
    assert "controller down" in c.get("/dashboard/state.json").json()["notes"][0]
    assert c.get("/dashboard").status_code == 200


@pytest.fixture
def served() -> Iterator[tuple[str, CountingState]]:
    state = CountingState()
    app = FastAPI()
    app.include_router(make_router(state, interval_ms=500))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):  # bounded wait for the socket (not a timing assertion)
        if server.started:
            break
        time.sleep(0.05)
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/dashboard", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.skipif(
    chromium_binary() is None and os.environ.get("CI") != "true",  # CI must have it: .ci/install-browser
    reason="Debian's chromium is not installed (see .ci/install-browser)",
)
def test_dashboard_refreshes_in_chromium(served: tuple[str, CountingState]) -> None:
    url, state = served
    dom = run_chromium(url, dump_dom=True, virtual_time_ms=5000)
    renders = int(re.search(r'data-rendered="(\d+)"', dom).group(1))  # type: ignore[union-attr]
    assert renders >= 3, "the page should have re-rendered from polled state"
    # the in-flight total shown is that of a later poll than the one that served the page (9 x n)
    shown = int(re.search(r'id="inflight" data-value="(\d+)"', dom).group(1))  # type: ignore[union-attr]
    assert shown % 9 == 0 and 9 < shown <= 9 * state.calls
    assert "live · updated" in dom
    assert re.search(r'<tr data-model="gateway-only">.*?480 ms', dom)
    assert re.search(r'<tr data-id="[^"]+\.prefill\.t412\.aws-us-east-2\.0">.*?starting', dom)
    assert 'id="total-cost" data-value="' in dom and f"${state.plan.cost_per_hour:,.2f}/h" in dom
    run_chromium(url, screenshot=ARTIFACTS / "dashboard.png", virtual_time_ms=2000)
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 50_000


def test_runtime_controller_shaped_state() -> None:
    """The shape coral.runtime's Controller.state publishes: plan summary, gateway counters, percentiles."""
    plan = example_plan()
    first = plan.instances[0]
    state = {
        "plan": {
            "scenario": plan.scenario,
            "method": plan.method,
            "cost_per_hour": plan.cost_per_hour,
            "n_instances": len(plan.instances),
            "serving": [s.model_dump() for s in plan.serving],
        },
        "instances": [
            {
                "id": first.id,
                "model": first.model,
                "phase": first.phase,
                "state": "pending",
                "served": 7,
                "inflight": 2,
                "target_share": 0.5,
                "observed_share": 0.4,
                "counts": first.counts,
            },
        ],
        "latency": {"phi-4": {"count": 12, "p50_ms": 310.0, "p99_ms": 900.5, "ttft_p50_ms": 120.0}},
        "traffic": {"qwen3-32b": {"prefill": {first.id: 0.4}}},
    }
    vm = live_view(state)
    assert vm["summary"]["cost_per_hour"] == pytest.approx(plan.cost_per_hour)
    assert len(vm["serving"]) == len(plan.serving)
    assert vm["notes"] == [
        "the state carries a plan summary only; publish the full plan JSON to draw the instances"
    ]
    row = vm["live"]["instances"][0]
    assert (row["state"], row["requests"], row["weight"], row["inflight"]) == ("pending", 7.0, 0.5, 2.0)
    assert vm["live"]["latency_summary"] == [
        {"model": "phi-4", "count": 12, "p50_ms": 310.0, "p99_ms": 900.5, "ttft_p50_ms": 120.0}
    ]
    assert vm["latency"] == []


def test_live_history_rates_in_flight_and_latency_from_successive_polls() -> None:
    """Hand-made polls 2 s apart: rate = growth of the request counters / 2 s; in flight and p99s as reported."""
    from coral.report.dashboard import LiveHistory

    clock = iter([100.0, 102.0, 104.0])
    history = LiveHistory(clock=lambda: next(clock))

    def vm(requests: float, inflight: float, ttft: float) -> dict[str, Any]:
        return {"live": {
            "instances": [{"model": "m", "requests": requests / 2, "inflight": inflight / 2}] * 2,
            "latency_summary": [{"model": "m", "ttft_p99_ms": ttft}],
        }}

    history.record(vm(10, 4, 300.0))
    history.record(vm(30, 6, 350.0))
    ts = history.record(vm(34, 2, 900.0))
    assert ts is not None
    assert ts["rate"]["m"] == [[2.0, 10.0], [4.0, 2.0]]
    assert ts["queue"]["m"] == [[0.0, 4.0], [2.0, 6.0], [4.0, 2.0]]
    assert ts["ttft_p99_ms"]["m"] == [[0.0, 300.0], [2.0, 350.0], [4.0, 900.0]]
    assert ts["tpot_p99_ms"]["m"] == [] and ts["bin_s"] == 2.0


def test_dashboard_state_carries_time_series_and_slos() -> None:
    state = CountingState()
    c = client(state)
    c.get("/dashboard/state.json")
    vm = c.get("/dashboard/state.json").json()
    ts = vm["timeseries"]
    assert set(ts["queue"]) == {i.model for i in state.plan.instances}
    assert all(len(v) == 2 for v in ts["queue"].values()) and all(len(v) == 1 for v in ts["rate"].values())
    assert vm["demand"] and all(d["slo_ttft_ms"] > 0 for d in vm["demand"])
