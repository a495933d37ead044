"""Coral pipeline engine as real processes: one process per node with torch.distributed (gloo) activations,
the HTTP server under the official `openai` client, and `coral serve --backend coral` with PD through the
gateway and controller. Outputs are compared token for token with the model run whole by transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from coral.engine.instance import CoralInstance
from coral.engine.reference import WholeModel
from coral.http_serving import free_port
from coral.runtime.coral_backend import SERVE_MODEL_LAYERS
from coral.runtime.handmade import make_instance, make_plan
from coral.tiny_model import TinyLlamaSpec, make_tiny, make_tiny_llama

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(420)  # process start-up is slow on a loaded 2-core machine

PROMPTS = [[11, 52, 300, 7], [500], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [999, 123, 45]]


def test_multiprocess_instance_with_openai_client(tmp_path):
    """2 stages, 2 data-parallel nodes of different types and TP degrees in the first (1xL4, 2xA10G): 4
    processes over gloo, the 2xA10G node as a tensor-parallel pair."""
    ckpt = make_tiny_llama(tmp_path / "tiny", TinyLlamaSpec(num_hidden_layers=4, initializer_range=0.25))
    plan_inst = make_instance("tiny", "decode", [(40, ["1xL4", "2xA10G"]), (24, ["1xL40S"])], 900.0)
    inst = CoralInstance.from_plan(plan_inst, ckpt, log_dir=tmp_path / "logs").start()
    try:
        assert inst.tp == [1, 2, 1] and len({p.pid for p in inst.procs}) == 4 and inst.alive()
        client = openai.OpenAI(base_url=f"{inst.url}/v1", api_key="unused")

        def complete(prompt: list[int]) -> list[int]:
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return list(r.choices[0].model_extra["token_ids"])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent requests: continuous batching
            outputs = list(pool.map(complete, PROMPTS))
        whole = WholeModel(ckpt)
        assert outputs == [whole.greedy(p, 6)[0] for p in PROMPTS]
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello pipeline"}], max_tokens=4, stream=True
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        inst.procs[-1].kill()  # a node dies: the instance reports unhealthy (the controller restarts it)
        inst.procs[-1].wait(10)
        assert not inst.alive() and httpx.get(f"{inst.url}/health").status_code == 503
    finally:
        inst.stop()
    assert all(p.poll() is not None for p in inst.procs)


def test_a_dead_node_fails_requests_in_flight_at_once(tmp_path):
    """2 stages as 2 processes; SIGKILL the last one while a streamed and a non-streamed request run: both end
    with the retryable error (503 + Retry-After; an SSE error event), /health names the node, new requests get
    503 at once. Without the watcher they would wait for tokens that never come (the clients' 120 s timeout)."""
    ckpt = make_tiny_llama(tmp_path / "tiny", TinyLlamaSpec(num_hidden_layers=4, initializer_range=0.25))
    plan_inst = make_instance("tiny", "decode", [(40, ["1xL4"]), (24, ["1xL40S"])], 900.0)
    inst = CoralInstance.from_plan(plan_inst, ckpt).start()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}
    url = f"{inst.url}/v1/completions"
    try:
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")  # streaming: the request is in flight
            plain = pool.submit(httpx.post, url, json=body, timeout=120)
            while inst.scheduler is not None and len(inst.scheduler.active) < 2:
                time.sleep(0.05)
            os.kill(inst.procs[-1].pid, signal.SIGKILL)
            rest = list(lines)
            r = plain.result()
        events = [ln for ln in rest if ln.startswith(("event:", "data:"))]
        assert events[-2] == "event: error", rest[-4:]
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "engine_unavailable" and "node 1" in error["message"]
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "engine_unavailable"
        health = httpx.get(f"{inst.url}/health")
        assert health.status_code == 503 and "node 1 (1xL40S" in health.json()["error"]["message"]
        assert httpx.post(url, json=body, timeout=120).status_code == 503
    finally:
        inst.stop()
    assert all(p.poll() is not None for p in inst.procs)


def serve_plan(tmp_path: Path, scenario: str, plan_path: Path, instances: int) -> tuple[subprocess.Popen[bytes], str]:
    """`coral serve SCENARIO --plan PLAN --backend coral` on loopback, once all `instances` are ready (the tiny
    checkpoints are made under `tmp_path/cache`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", scenario, "--plan", str(plan_path), "--backend",
           "coral", "--port", str(port), "--db", str(tmp_path / "serve.sqlite")]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    ready, st = 0, {}
    while time.monotonic() < deadline and proc.poll() is None and ready < instances:
        try:
            st = httpx.get(f"{url}/state", timeout=2).json()
            ready = sum(i["state"] == "ready" for i in st["instances"])
        except httpx.HTTPError:
            ready = 0
        time.sleep(0.2)
    if ready < instances:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode() if proc.stdout else ""
        raise AssertionError(f"{ready}/{instances} instances ready: {out[-3000:] or st}")
    return proc, url


def served_tokens(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(r.choices[0].model_extra["token_ids"])


def tiny_served(tmp_path: Path, arch: str) -> Path:
    """The tiny checkpoint of `arch` the backend made (checked unchanged: same spec, no rewrite)."""
    ckpt = tmp_path / "cache" / "coral" / f"tiny-{arch}"
    spec = TinyLlamaSpec(num_hidden_layers=SERVE_MODEL_LAYERS, initializer_range=0.25)
    assert make_tiny(arch, ckpt, spec) == ckpt
    return ckpt


def test_coral_serve_backend_coral_pd_through_gateway(tmp_path):
    """`coral serve --backend coral`: prefill on [40 | 24] layers (a TP-2 node first), decode on [16 | 48] with
    2 nodes in its second stage (one TP-2); the gateway's PD path hands the KV over re-sharded by layer (and by
    head between TP degrees); outputs exact."""
    plan = make_plan([
        make_instance("phi-4", "prefill", [(40, ["2xL40S"]), (24, ["1xL4"])], 6000.0, template_id=1),
        make_instance("phi-4", "decode", [(16, ["1xL4"]), (48, ["1xL4", "2xA10G"])], 500.0, template_id=2),
    ])
    proc, url = serve_plan(tmp_path, "core", plan.save(tmp_path / "plan.json"), 2)
    try:
        got = served_tokens(url, "phi-4", PROMPTS[2], 5)
        assert got == WholeModel(tiny_served(tmp_path, "phi3")).greedy(PROMPTS[2], 5)[0]  # phi-4's architecture
        instances = httpx.get(f"{url}/state").json()["instances"]
        assert {i["phase"]: i["served"] for i in instances} == {"prefill": 1, "decode": 1}
        (decode_url,) = [i["url"] for i in instances if i["phase"] == "decode"]
        assert httpx.get(f"{decode_url}/health").json()["remote_prefills"] == 1  # KV taken, not recomputed
        direct = httpx.post(f"{decode_url}/v1/completions", json={"model": "phi-4", "prompt": PROMPTS[2]})
        assert direct.status_code == 401  # the engines answer only the gateway's token
    finally:
        proc.terminate()
        proc.wait(30)


#: one model of each architecture of the catalog, in the `extended` scenario
ARCH_MODELS = {"phi-4": "phi3", "gpt-oss-20b": "gpt_oss", "qwen3-32b": "qwen3", "llama-3-70b": "llama",
               "qwen3-235b": "qwen3_moe"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_catalog_architecture_through_coral_serve_on_a_heterogeneous_pd_plan(tmp_path):
    """`coral serve extended --backend coral` with a heterogeneous PD pair per architecture (prefill: 2 stages on
    different node configs; decode: one stage of 2 data-parallel nodes of different configs): every model's
    answer through the gateway equals transformers' greedy output on the tiny checkpoint of its architecture,
    the KV handed over from prefill to decode."""
    instances = []
    for t, model in enumerate(ARCH_MODELS):
        instances += [make_instance(model, "prefill", [(1, ["1xL4"]), (3, ["1xL40S"])], 6000.0, template_id=2 * t),
                      make_instance(model, "decode", [(4, ["1xA10G", "1xL4"])], 500.0, template_id=2 * t + 1)]
    proc, url = serve_plan(tmp_path, "extended", make_plan(instances).save(tmp_path / "plan.json"), len(instances))
    try:
        for model, arch in ARCH_MODELS.items():
            want = WholeModel(tiny_served(tmp_path, arch)).greedy(PROMPTS[2], 5)[0]
            assert served_tokens(url, model, PROMPTS[2], 5) == want, model
        decode = [i for i in httpx.get(f"{url}/state").json()["instances"] if i["phase"] == "decode"]
        assert all(httpx.get(f"{i['url']}/health").json()["remote_prefills"] == 1 for i in decode)
    finally:
        proc.terminate()
        proc.wait(60)


def test_nodes_started_from_the_plan_on_their_machines(tmp_path):
    """The cluster path without Ray: the scheduler with `--no-launch --results-port`, and each node started by
    `python -m coral.engine.node --plan ... --node-rank R` (what `coral deploy --engine coral` renders), on loopback."""
    ckpt = make_tiny_llama(tmp_path / "tiny", TinyLlamaSpec(num_hidden_layers=4, initializer_range=0.25))
    plan = make_plan([make_instance("tiny", "decode", [(40, ["2xA10G"]), (24, ["1xL4"])], 900.0)])
    plan_path = plan.save(tmp_path / "plan.json")
    iid = plan.instances[0].id
    port, results, rdzv = free_port(), free_port(), free_port()
    common = ["--dist-init", f"tcp://127.0.0.1:{rdzv}"]
    procs = [subprocess.Popen([sys.executable, "-m", "coral.engine.instance", str(plan_path), iid, str(ckpt),
                               "--no-launch", "--port", str(port), "--results-port", str(results), *common],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)]
    procs += [subprocess.Popen([sys.executable, "-m", "coral.engine.node", "--plan", str(plan_path), "--instance", iid,
                                "--checkpoint", str(ckpt), "--node-rank", str(r), "--host", "127.0.0.1",
                                "--scheduler", f"tcp://127.0.0.1:{results}", *common]) for r in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == WholeModel(ckpt).greedy(PROMPTS[0], 5)[0]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def test_racing_writers_of_one_tiny_model_leave_the_weights_one_writer_makes(tmp_path):
    """A controller thread and a test thread both asking for the serving model (the Ray cluster test's race): the
    weights are those a lone call writes, and the callers' torch generator is left as it was."""
    import torch
    from safetensors.torch import load_file

    spec = TinyLlamaSpec(num_hidden_layers=2, initializer_range=0.25)
    alone = load_file(make_tiny_llama(tmp_path / "alone", spec) / "model.safetensors")
    torch.manual_seed(123)
    before = torch.rand(4)
    torch.manual_seed(123)
    with ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: make_tiny_llama(tmp_path / "raced", spec), range(3)))
    assert torch.equal(torch.rand(4), before)
    raced = load_file(dirs[0] / "model.safetensors")
    assert raced.keys() == alone.keys() and all(torch.equal(raced[k], alone[k]) for k in alone)
