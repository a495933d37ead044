"""`coral serve --backend coral --ray` as users run it: a CLI process joining an existing Ray cluster through
`RAY_ADDRESS` (a multi-node cluster of raylets on this machine, each advertising its node config), serving a PD
plan exact against the whole model through its gateway, and leaving nothing behind on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from coral.engine.reference import WholeModel
from coral.http_serving import free_port
from coral.runtime.handmade import make_instance, make_plan
from coral.tiny_model import TinyLlamaSpec, make_tiny_llama

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PLAN = make_plan([
    make_instance("phi-4", "prefill", [(64, ["1xL4"])], 6000.0, template_id=1),
    make_instance("phi-4", "decode", [(24, ["1xL4"]), (40, ["2xA10G"])], 500.0, template_id=2),
])
PROMPT = [11, 52, 300, 7, 8]


def processes_naming(text: str) -> list[int]:
    """Pids of this machine's processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_coral_serve_joins_a_ray_cluster_by_address(tmp_path):
    from coral.runtime.ray_backend import LocalRayCluster

    cluster = LocalRayCluster(Counter({"1xL4": 2, "2xA10G": 1}))
    ckpt = make_tiny_llama(tmp_path / "ckpt", TinyLlamaSpec(num_hidden_layers=4, initializer_range=0.25))
    port = free_port()
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(PLAN.save(tmp_path / "plan.json")),
           "--backend", "coral", "--ray", "--engine-host", "127.0.0.1", "--checkpoint", str(ckpt),
           "--port", str(port), "--db", str(tmp_path / "serve.sqlite")]
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": cluster.address})
    url = f"http://127.0.0.1:{port}"
    st: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                st = httpx.get(f"{url}/state", timeout=2).json()
                if sum(i["state"] == "ready" for i in st["instances"]) == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert sum(i["state"] == "ready" for i in st.get("instances", [])) == 2, (tmp_path / "serve.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="phi-4", prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == WholeModel(ckpt).greedy(PROMPT, 6)[0]
        (decode_url,) = [i["url"] for i in st["instances"] if i["phase"] == "decode"]
        assert httpx.get(f"{decode_url}/health").json()["remote_prefills"] == 1  # KV taken across Ray nodes
        assert processes_naming(str(ckpt)), "the node processes run from the given checkpoint"
        ray.init(address=cluster.address, log_to_driver=False)
        try:  # the instances were placed on this cluster, one placement group each
            groups = ray.util.placement_group_table().values()
            assert sorted(len(g["bundles"]) for g in groups if g["state"] == "CREATED") == [1, 2]
        finally:
            ray.shutdown()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:  # hung on SIGTERM: still stop it and the cluster, then fail below
            proc.kill()
            rc = proc.wait()
        log.close()
        deadline = time.monotonic() + 30
        while processes_naming(str(ckpt)) and time.monotonic() < deadline:  # node processes end with their actors
            time.sleep(0.5)
        left = processes_naming(str(ckpt))
        cluster.shutdown()
    assert rc == 0 and not left, (tmp_path / "serve.log").read_text()
