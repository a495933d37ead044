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
from openai.types.chat import ChatCompletionMessageParam

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


@pytest.mark.browser
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


def test_live_history_rates_in_flight_and_latency_from_successive_samples() -> None:
    """Hand-made samples 2 s apart of a prefill and a decode instance: rate = growth of the client requests
    (each counted once, on the decode instance that answered it) / 2 s; in flight and p99s as reported; a ring
    buffer of keep_s / sample_s points."""
    from coral.report.dashboard import LiveHistory, live_numbers

    clock = iter([100.0, 102.0, 104.0, 106.0])
    history = LiveHistory(keep_s=6.0, sample_s=2.0, clock=lambda: next(clock))

    def state(requests: float, inflight: float, ttft: float) -> dict[str, Any]:
        return {
            "instances": [{"id": f"m.{ph}", "model": "m", "phase": ph, "served": requests, "inflight": inflight / 2}
                          for ph in ("prefill", "decode")],
            "latency": {"m": {"ttft_p99_ms": ttft}},
        }

    assert history.series() is None
    history.record(live_numbers(state(10, 4, 300.0)))
    history.record(live_numbers(state(30, 6, 350.0)))
    history.record(live_numbers(state(34, 2, 900.0)))
    ts = history.series()
    assert ts is not None
    assert ts["rate"]["m"] == [[2.0, 10.0], [4.0, 2.0]]
    assert ts["queue"]["m"] == [[0.0, 4.0], [2.0, 6.0], [4.0, 2.0]]
    assert ts["ttft_p99_ms"]["m"] == [[0.0, 300.0], [2.0, 350.0], [4.0, 900.0]]
    assert ts["tpot_p99_ms"]["m"] == [] and ts["bin_s"] == 2.0 and ts["keep_s"] == 6.0
    history.record(live_numbers(state(40, 0, 100.0)))  # the buffer holds 3 points: the oldest goes
    assert [t for t, _ in history.series()["queue"]["m"]] == [2.0, 4.0, 6.0]  # type: ignore[index]


def test_client_requests_count_once_and_the_gateway_counters_win() -> None:
    """Without counters, a request prefilled on one instance and decoded on another counts once (its decode);
    a model served by prefill instances alone counts there; the gateway's `requests` replace both."""
    rows = [
        {"id": "a.p", "model": "a", "phase": "prefill", "served": 7},
        {"id": "a.d0", "model": "a", "phase": "decode", "served": 4},
        {"id": "a.d1", "model": "a", "phase": "decode", "served": 3},
        {"id": "b.p", "model": "b", "phase": "prefill", "served": 5},
    ]
    live = live_view({"instances": rows})["live"]
    assert (live["requests_by_model"], live["total_requests"]) == ({"a": 7.0, "b": 5.0}, 12.0)
    counted = live_view({"instances": rows, "latency": {"a": {"requests": 9, "p50_ms": 3.0}}})["live"]
    assert (counted["requests_by_model"], counted["total_requests"]) == ({"a": 9.0}, 9.0)


def test_history_is_sampled_on_the_server_not_by_page_loads() -> None:
    """While the app runs, the state is sampled every sample_s into the history: the first poll, however late,
    shows the points gathered before it; polls add none."""
    state = CountingState()
    app = FastAPI()
    app.include_router(make_router(state, interval_ms=300, sample_s=0.05))
    with TestClient(app) as c:
        deadline = time.monotonic() + 20
        while state.calls < 4 and time.monotonic() < deadline:  # bounded wait for the sampler's calls
            time.sleep(0.02)
        vm = c.get("/dashboard/state.json").json()
        ts = vm["timeseries"]
        assert set(ts["queue"]) == {i.model for i in state.plan.instances}
        assert all(len(v) >= 3 for v in ts["queue"].values()) and all(len(v) >= 2 for v in ts["rate"].values())
        assert ts["keep_s"] == 3600.0 and 0 < ts["bin_s"] < 5
        assert vm["demand"] and all(d["slo_ttft_ms"] > 0 for d in vm["demand"])
    stopped = state.calls
    time.sleep(0.2)
    assert state.calls == stopped, "the sampler stops with the app"
    assert client(state).get("/dashboard/state.json").json()["timeseries"] is None  # no lifespan, no samples


# --- the real runtime: gateway + controller + emulated engines on loopback, driven by the openai client -------
N_PLAIN, N_STREAMED = 7, 5


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`coral serve`'s app (`build_runtime`) over a prefill + decode plan of phi-4, history sampled every 50 ms."""
    from functools import partial

    from coral.catalog.loader import load_scenario
    from coral.cli import runtime as cli_runtime
    from coral.http_serving import ServerThread
    from coral.report import dashboard
    from coral.runtime.backends import EmulatedBackend
    from coral.runtime.controller import Store
    from coral.runtime.handmade import make_instance, make_plan

    fast = partial(dashboard.make_router, sample_s=0.05)
    monkeypatch.setattr(dashboard, "make_router", fast)  # build_runtime imports it when called ...
    monkeypatch.setattr(cli_runtime, "make_router", fast, raising=False)  # ... or at import
    plan = make_plan([make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 6000.0, template_id=1),
                      make_instance("phi-4", "decode", [(40, ["1xL4"])], 500.0, template_id=2)])
    engines = EmulatedBackend(time_scale=0.05, scenario=load_scenario("core"))
    app, controller = cli_runtime.build_runtime(lambda: plan, Store(tmp_path / "rt.sqlite"), engines, 3600)
    server = ServerThread(app).start()
    try:
        controller.replan()  # asks the planner, starts the engines and waits for them
        yield server.url
    finally:
        server.stop()
        controller.stop()
        engines.close()


@pytest.mark.timeout(120)
def test_dashboard_of_the_running_gateway_counts_and_times_each_client_request(runtime: str) -> None:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{runtime}/v1", api_key="unused", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there, how are you today?"}]
    for _ in range(N_PLAIN):
        answer = client.chat.completions.create(model="phi-4", messages=messages, max_tokens=6)
        assert answer.usage is not None and answer.usage.completion_tokens == 6
    for _ in range(N_STREAMED):
        chunks = client.chat.completions.create(model="phi-4", messages=messages, max_tokens=6, stream=True)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6
    n = N_PLAIN + N_STREAMED
    state = httpx.get(f"{runtime}/state", timeout=10).json()
    assert sum(i["served"] for i in state["instances"]) == 2 * n  # each request prefilled, then decoded

    def history() -> tuple[dict[str, Any], float, bool]:
        """The dashboard's state, its newest sample's time (-1 before any) and whether it has a TPOT point."""
        view = httpx.get(f"{runtime}/dashboard/state.json", timeout=10).json()
        series = view["timeseries"] or {}
        queue = series.get("queue", {}).get("phi-4", [])
        return view, queue[-1][0] if queue else -1.0, bool(series.get("tpot_p99_ms", {}).get("phi-4"))

    vm, seen, _ = history()  # every sample after the newest one here was taken after the last request ended
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # bounded wait for such a sample
        vm, newest, has_tpot = history()
        if newest > seen and has_tpot and len(vm["timeseries"]["queue"]["phi-4"]) >= 3:
            break
        time.sleep(0.05)
    live = vm["live"]
    assert live["total_requests"] == n and live["requests_by_model"] == {"phi-4": n}
    (row,) = live["latency_summary"]
    assert (row["model"], row["requests"], row["errors"], row["count"]) == ("phi-4", n, 0, n)
    # end-to-end latency and time to first token are separate measurements: every answer had 6 tokens after it
    assert 0 < row["ttft_p50_ms"] < row["p50_ms"] and 0 < row["ttft_p99_ms"] < row["p99_ms"]
    assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"] < row["p99_ms"]
    ts = vm["timeseries"]
    assert ts["tpot_p99_ms"]["phi-4"] and ts["ttft_p99_ms"]["phi-4"] and ts["rate"]["phi-4"]
    assert sum(ts["rate"]["phi-4"][k][1] * (ts["rate"]["phi-4"][k][0] - ts["queue"]["phi-4"][k][0])
               for k in range(len(ts["rate"]["phi-4"]))) == pytest.approx(n), "the rate integrates to n requests"
    assert vm["title"] == "Coral dashboard — handmade (handmade) for the Coral engine"


@pytest.mark.browser
@pytest.mark.skipif(
    chromium_binary() is None and os.environ.get("CI") != "true",  # CI must have it: .ci/install-browser
    reason="Debian's chromium is not installed (see .ci/install-browser)",
)
@pytest.mark.timeout(120)
def test_dashboard_of_the_running_gateway_in_chromium(runtime: str) -> None:
    """The page opened after the requests: client requests counted once, distinct latency columns, and the
    history (TPOT included) drawn from the server's samples."""
    import openai

    client = openai.OpenAI(base_url=f"{runtime}/v1", api_key="unused", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
    for _ in range(N_PLAIN):
        client.chat.completions.create(model="phi-4", messages=messages, max_tokens=5)
    for _ in range(N_STREAMED):
        list(client.chat.completions.create(model="phi-4", messages=messages, max_tokens=5, stream=True))
    time.sleep(0.3)  # a few history samples after the last request
    dom = run_chromium(f"{runtime}/dashboard", dump_dom=True)
    assert re.search(rf'id="total-requests" data-value="{N_PLAIN + N_STREAMED}"', dom)
    headers = re.findall(r"<th[^>]*>([^<]+)</th>", dom[dom.index('id="live-latency"'):])[:10]
    assert headers[:10] == ["Model", "Requests", "Errors", "Window", "e2e p50", "e2e p99", "TTFT p50", "TTFT p99",
                            "TPOT p50", "TPOT p99"]
    chart = dom[dom.index('id="ts-tpot_p99_ms"'):dom.index("</svg>", dom.index('id="ts-tpot_p99_ms"'))]
    assert re.search(r'<path d="M[\d.]+,[\d.]+L', chart), "the p99 TPOT line has points"
    assert "sampled on the server" in dom
    run_chromium(f"{runtime}/dashboard", screenshot=ARTIFACTS / "dashboard-runtime.png", virtual_time_ms=1000)


@pytest.mark.timeout(120)
def test_coral_serve_prints_the_dashboard_url(tmp_path: Path) -> None:
    """`coral serve` says where its dashboard is, and the page is there."""
    import subprocess
    import sys

    import httpx

    from coral.http_serving import free_port
    from coral.runtime.handmade import make_instance, make_plan

    plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL4"])], 500.0)]).save(tmp_path / "plan.json")
    port = free_port()
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(plan), "--port", str(port),
           "--time-scale", "0.001", "--db", str(tmp_path / "serve.sqlite")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # ends when the process does
            lines.append(line)
            if "dashboard http" in line:
                break
        url = re.search(r"dashboard (http://\S+)", "".join(lines))
        assert url and url.group(1) == f"http://127.0.0.1:{port}/dashboard", lines
        deadline = time.monotonic() + 30
        while True:  # bounded wait for the socket
            try:
                page = httpx.get(url.group(1), timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the dashboard never answered"
                time.sleep(0.1)
        assert page.status_code == 200 and "Coral dashboard" in page.text
    finally:
        proc.terminate()
        proc.wait(20)


def test_token_clock_times_streamed_tokens_not_openings_usage_or_done() -> None:
    """vLLM opens a chat stream with a role-only event and may end with a usage event; events can be split
    across chunks (and use CRLF). Tokens at t = 1, 2, 4 s: TTFT from the first, TPOT = (4 - 1) / 2."""
    import json

    from coral.runtime.gateway import TokenClock

    def event(delta: dict[str, Any] | None, usage: bool = False) -> bytes:
        body = {"choices": [] if delta is None else [{"index": 0, "delta": delta}]}
        return f"data: {json.dumps({**body, 'usage': {'completion_tokens': 3}} if usage else body)}\r\n\r\n".encode()

    clock = TokenClock()
    clock.feed(event({"role": "assistant", "content": ""}), 0.5)
    first = event({"content": "a"})
    clock.feed(first[:10], 0.9)
    clock.feed(first[10:] + event({"content": "b"})[:-1], 1.0)  # completes token a; b ends with its last byte
    clock.feed(b"\n", 2.0)
    clock.feed(event({"content": "c"}) + event(None, usage=True) + b"data: [DONE]\n\n", 4.0)
    assert (clock.tokens, clock.first, clock.last, clock.tpot_s) == (3, 1.0, 4.0, 1.5)
    completion = TokenClock()
    completion.feed(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n', 3.0)
    assert (completion.tokens, completion.first, completion.tpot_s) == (1, 3.0, None)
