"""Coral pipeline engine, in-process (nodes as threads, same node and scheduler code): greedy outputs of any
layout (1..4 stages, uneven layers, data-parallel nodes, concurrent requests in flattened micro-batches, chunked
prefills under a token budget, small paged KV pools that make requests wait and be preempted, PD between
different layouts) are token-identical to the model run whole by transformers, with logits within RTOL."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coral.engine.instance import CoralInstance, EngineConfig
from coral.engine.layout import Layout, scale_layers
from coral.engine.reference import WholeModel
from coral.engine.scheduler import Request, Scheduler, SmoothWRR
from coral.engine.shard import KVPool, PoolFull, Shard, free_memory
from coral.runtime.handmade import make_instance
from coral.tiny_model import TinyLlamaSpec, make_tiny_llama

pytestmark = pytest.mark.timeout(300)

N_LAYERS = 6
# Logits: a micro-batch runs its tokens as one matrix (the reference runs each request alone), so float32 GEMMs
# sum in a different order; the difference stays below 1e-4 of the step's largest logit (float32's epsilon is
# 1.2e-7, accumulated over 6 layers of 256/512-wide sums). Tokens are compared exactly.
RTOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    spec = TinyLlamaSpec(num_hidden_layers=N_LAYERS, initializer_range=0.25)
    return make_tiny_llama(tmp_path_factory.mktemp("engine") / "tiny", spec)


@pytest.fixture(scope="module")
def whole(ckpt):
    return WholeModel(ckpt)


def run_requests(
    inst: CoralInstance, prompts: list[list[int]], max_tokens: list[int]
) -> list[tuple[list[int], torch.Tensor, list[str | None]]]:
    """Submit all requests at once (no stop at EOS); per request: tokens, logits per step, finish reasons."""
    assert inst.scheduler is not None
    done = [threading.Event() for _ in prompts]
    results: list[tuple[list[int], list[list[float]], list[str | None]]] = [([], [], []) for _ in prompts]

    def on_event(i: int):  # type: ignore[no-untyped-def]
        def handle(token, finish, logits):  # type: ignore[no-untyped-def]
            if token is not None:
                results[i][0].append(token)
                results[i][1].append(logits)
            results[i][2].append(finish)
            if finish is not None:
                done[i].set()

        return handle

    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        inst.scheduler.submit(Request(rid=f"r{i}", prompt=p, max_tokens=n, on_event=on_event(i), want_logits=True))
    for ev in done:
        assert ev.wait(120), "request not finished"
    return [(t, torch.tensor(lg), f) for t, lg, f in results]


def assert_exact(whole: WholeModel, prompts, max_tokens, results) -> None:  # type: ignore[no-untyped-def]
    for p, n, (tokens, logits, finishes) in zip(prompts, max_tokens, results, strict=True):
        ref_tokens, ref_logits = whole.greedy(p, n)
        assert tokens == ref_tokens
        scale = ref_logits.abs().amax(-1, keepdim=True)
        assert ((logits - ref_logits).abs() <= RTOL * scale).all(), float(((logits - ref_logits).abs() / scale).max())
        assert finishes[-1] == "length" and finishes[:-1] == [None] * (n - 1)


def local(layout: Layout, ckpt, **kw) -> CoralInstance:  # type: ignore[no-untyped-def]
    return CoralInstance(layout, ckpt, EngineConfig(local=True, http=kw.pop("http", False), **kw)).start()


# --- layout and routing ------------------------------------------------------------------------------------


def test_scale_layers_golden():
    assert scale_layers([40, 24], 4) == [2, 2]
    assert scale_layers([60, 4], 4) == [3, 1]
    assert scale_layers([10, 10, 10, 10], 4) == [1, 1, 1, 1]
    assert scale_layers([3, 5], 8) == [3, 5]
    with pytest.raises(ValueError, match="fewer than the instance's 5 stages"):
        scale_layers([1] * 5, 4)


@given(st.lists(st.integers(1, 80), min_size=1, max_size=6), st.integers(6, 40))
@settings(max_examples=60, derandomize=True, deadline=None)
def test_scale_layers_properties(layers, total):
    out = scale_layers(layers, total)
    assert sum(out) == total and min(out) >= 1 and len(out) == len(layers)
    for i in range(len(layers)):  # a stage planned larger never gets fewer layers
        for j in range(len(layers)):
            if layers[i] > layers[j]:
                assert out[i] >= out[j]


def test_layout_from_plan_scales_split_and_keeps_nodes():
    inst = make_instance("m", "decode", [(40, ["1xL4", "1xA10G"]), (24, ["1xL40S"])], 900.0)
    layout = Layout.from_plan(inst, 4)
    assert [(n.rank, n.stage, n.config, n.first, n.last) for n in layout.nodes] == [
        (0, 0, "1xL4", 0, 2), (1, 0, "1xA10G", 0, 2), (2, 1, "1xL40S", 2, 4),
    ]
    assert [n.rank for n in layout.holders(3)] == [2] and layout.n_layers == 4


def test_smooth_wrr_golden_and_proportional():
    wrr = SmoothWRR([5, 1, 1])
    assert [wrr.pick() for _ in range(7)] == [0, 0, 1, 0, 2, 0, 0]  # nginx's interleaving
    wrr = SmoothWRR([300.0, 100.0])
    picks = [wrr.pick() for _ in range(400)]
    assert picks.count(0) == 300


# --- exactness -------------------------------------------------------------------------------------------


@st.composite
def layouts(draw):  # type: ignore[no-untyped-def]
    n_stages = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(1, N_LAYERS - 1), min_size=n_stages - 1, max_size=n_stages - 1,
                                unique=True)))
    bounds = [0, *cuts, N_LAYERS]
    layers = [b - a for a, b in itertools.pairwise(bounds)]
    widths = draw(st.lists(st.integers(1, 2), min_size=n_stages, max_size=n_stages))
    weights = [[draw(st.sampled_from([1.0, 2.0, 5.0])) for _ in range(w)] for w in widths]
    return Layout.of(layers, [[f"n{s}.{k}" for k in range(w)] for s, w in enumerate(widths)], weights)


@given(layout=layouts(), seed=st.integers(0, 2**16), budget=st.sampled_from([3, 7, 4096]),
       blocks=st.sampled_from([6, 0]))
@settings(max_examples=16, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_layouts_match_the_whole_model(ckpt, whole, layout, seed, budget, blocks):
    """Any layout, token budget (3 and 7 chunk the prefills) and KV pool (6 blocks of 4 tokens: fewer than 3
    requests of up to 18 tokens need, so requests wait and are preempted) gives the whole model's tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(7, 1024) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    max_tokens = [rng.randint(1, 6) for _ in prompts]
    inst = local(layout, ckpt, max_batch_tokens=budget, kv_blocks=blocks, kv_block_size=4)
    try:
        results = run_requests(inst, prompts, max_tokens)
        assert inst.scheduler is not None
        assert inst.scheduler.free == inst.scheduler.capacity  # every block back
    finally:
        inst.stop()
    assert_exact(whole, prompts, max_tokens, results)


def test_continuous_batching_many_requests_is_exact(ckpt, whole):
    """12 requests of different lengths at once over DP nodes: micro-batches mix prefills and decode steps and
    requests join and leave them, outputs unchanged."""
    rng = random.Random(7)
    layout = Layout.of([1, 3, 2], [["a", "b"], ["c"], ["d", "e"]], [[1, 2], [1], [3, 1]])
    prompts = [[rng.randrange(7, 1024) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    inst = local(layout, ckpt, max_batch=4, max_inflight=3)
    try:
        results = run_requests(inst, prompts, max_tokens)
        assert inst.scheduler is not None
        batches = inst.scheduler.batches
    finally:
        inst.stop()
    assert_exact(whole, prompts, max_tokens, results)
    assert batches < sum(max_tokens)  # several requests per micro-batch


def test_small_kv_pool_preempts_and_recomputes_exactly(ckpt, whole):
    """8 requests on a pool of 10 blocks of 4 tokens with chunked prefill (budget 6): requests are admitted only
    when their blocks fit, the newest are preempted when decode runs out of blocks, recomputed, and every output
    is the whole model's; the pool is empty afterwards and never held more than it has."""
    rng = random.Random(11)
    layout = Layout.of([2, 4], [["a"], ["b"]])
    prompts = [[rng.randrange(7, 1024) for _ in range(rng.randint(3, 14))] for _ in range(8)]
    max_tokens = [rng.randint(4, 12) for _ in prompts]
    inst = local(layout, ckpt, max_batch_tokens=6, kv_blocks=10, kv_block_size=4)
    try:
        results = run_requests(inst, prompts, max_tokens)
        sched = inst.scheduler
        assert sched is not None
        assert sched.preemptions > 0 and sched.free == sched.capacity == {0: 10, 1: 10}
        assert max(sched.peak_blocks.values()) == 10
        done = threading.Event()
        events: list[str | None] = []
        too_long = Request(rid="long", prompt=[9] * 30, max_tokens=20,
                           on_event=lambda t, f, lg: (events.append(f), done.set()))
        sched.submit(too_long)  # 50 tokens need 13 blocks: never fits, refused at once
        assert done.wait(10) and events == ["error"] and not sched.active
    finally:
        inst.stop()
    assert_exact(whole, prompts, max_tokens, results)


def test_token_budget_decode_first_then_chunked_prefill():
    """Micro-batch formation alone (no nodes): decode steps first, then the oldest waiting prompt chunked to the
    budget left; a waiting request that does not fit stops admission behind it."""
    import zmq

    sched = Scheduler(Layout.of([6], [["a"]]), zmq.Context.instance(), "inproc://budget-test", max_batch=8,
                      max_batch_tokens=10)
    try:
        sched.block_size, sched.capacity, sched.free = 4, {0: 12}, {0: 12}
        reqs = {name: Request(rid=name, prompt=[9] * n, max_tokens=4, on_event=lambda t, f, lg: None)
                for name, n in [("p1", 12), ("d1", 5), ("p2", 3), ("d2", 6)]}
        for req in reqs.values():
            sched._admit(req)
        for name in ("d1", "d2"):  # running: prompt computed, one token to decode
            req = reqs[name]
            req.position, req.pending = len(req.prompt), [7]
            sched._hold(req, sched._blocks_for(req.position))
        batch = sched._form((0,), list(reqs.values()))
        assert [(r.rid, n) for r, n in batch] == [("d1", 1), ("d2", 1), ("p1", 8)]
        assert sched.free == {0: 12 - 2 - 2 - 2}  # d1, d2 keep their 2 blocks each; p1's 8 tokens take 2
        reqs["p1"].position, reqs["p1"].pending = 8, reqs["p1"].pending[8:]
        for r in (reqs["d1"], reqs["d2"]):
            r.position, r.pending = r.position + 1, [7]
        sched.free[0] = 1  # the pool nearly full: p1's last chunk needs 1 block, p2 would need 1 more
        batch = sched._form((0,), list(reqs.values()))
        assert [(r.rid, n) for r, n in batch] == [("d1", 1), ("d2", 1), ("p1", 4)]
        assert sched.free == {0: 0} and reqs["p2"].blocks == 0  # p2 waits for blocks
    finally:
        for sock in (sched.results, sched.wake_in, sched.wake_out):
            sock.close(linger=0)


def test_kv_pool_blocks_and_slots():
    pool = KVPool(layers=2, blocks=4, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32,
                  device=torch.device("cpu"))
    pool.reserve("a", 5)
    pool.reserve("b", 3)
    assert pool.tables == {"a": [0, 1], "b": [2]} and pool.used == 3
    assert pool.slots("a", 3, 5).tolist() == [3, 4] and pool.slots("b", 0, 2).tolist() == [8, 9]
    with pytest.raises(PoolFull):
        pool.reserve("b", 13)  # 3 more blocks, 1 free
    pool.release("a")
    pool.reserve("b", 12)
    assert pool.tables["b"] == [2, 0, 1] and pool.used == 3
    assert KVPool.bytes_per_block(2, 4, 1, 2, torch.float32) == 2 * 2 * 4 * 1 * 2 * 4


def test_kv_pool_sized_by_budget(ckpt):
    """The pool takes what the budget holds: GiB, or a fraction of the device's free memory."""
    per_block = KVPool.bytes_per_block(2, 16, 2, 64, torch.float32)  # layers 0-1 of the test model
    assert Shard(ckpt, 0, 2, kv_cache_gib=0.01).pool.blocks == int(0.01 * 2**30) // per_block
    free = free_memory(torch.device("cpu"))
    blocks = Shard(ckpt, 0, 2, kv_cache_fraction=1e-4).pool.blocks
    assert 0.5 < blocks / (1e-4 * free / per_block) < 1.5


def test_paths_follow_node_weights(ckpt):
    layout = Layout.of([3, 3], [["a", "b"], ["c"]], [[3.0, 1.0], [1.0]])
    inst = local(layout, ckpt)
    assert inst.scheduler is not None
    finished = threading.Semaphore(0)
    reqs = [Request(rid=f"p{i}", prompt=[9, 10], max_tokens=1, on_event=lambda t, f, lg: finished.release())
            for i in range(8)]
    try:
        for req in reqs:
            inst.scheduler.submit(req)
        for _ in reqs:
            assert finished.acquire(timeout=30)
    finally:
        inst.stop()
    first_stage = [r.path[0] for r in reqs]
    assert first_stage.count(0) == 6 and first_stage.count(1) == 2 and {r.path[1] for r in reqs} == {2}


def test_pd_between_different_layouts_is_exact(ckpt, whole):
    """Prefill on 2 stages [4, 2], decode on 3 stages [1, 2, 3] with 2 nodes in the middle stage: each decode
    node takes exactly its layers from the prefill node holding them, over the HTTP PD protocol."""
    pre = local(Layout.of([4, 2], [["p0"], ["p1"]], instance_id="pre", model="tiny"), ckpt, http=True)
    dec = local(Layout.of([1, 2, 3], [["d0"], ["d1", "d2"], ["d3"]], instance_id="dec", model="tiny"), ckpt,
                http=True)
    rng = random.Random(3)
    try:
        for n_prompt, n_out in [(5, 6), (1, 3), (13, 1), (8, 4)]:
            prompt = [rng.randrange(7, 1024) for _ in range(n_prompt)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": n_out, "ignore_eos": True,
                    "return_token_ids": True, "temperature": 0}
            pd = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            first = httpx.post(f"{pre.url}/v1/completions", json=pd, timeout=30).json()
            kv = first["kv_transfer_params"]
            assert kv["do_remote_prefill"] and [s["first"] for s in kv["coral"]["sources"]] == [0, 4]
            out = httpx.post(f"{dec.url}/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=30)
            ref, _ = whole.greedy(prompt, n_out)
            assert out.json()["choices"][0]["token_ids"] == ref
            assert first["choices"][0]["token_ids"] == ref[:1]
        # KV already taken (or expired): the decode instance prefills locally, output unchanged
        out = httpx.post(f"{dec.url}/v1/completions", json={**body, "kv_transfer_params": kv}, timeout=30)
        assert out.json()["choices"][0]["token_ids"] == ref
        assert pre.scheduler is not None and dec.scheduler is not None
        assert not dec.scheduler.active and not pre.scheduler.active and dec.scheduler.remote_prefills == 4
        for _ in range(200):  # the prefill nodes report the KV taken: its blocks are free again
            if pre.scheduler.free == pre.scheduler.capacity and not pre.scheduler.kept:
                break
            time.sleep(0.05)
        assert pre.scheduler.free == pre.scheduler.capacity and not pre.scheduler.kept
        assert dec.scheduler.free == dec.scheduler.capacity
    finally:
        pre.stop()
        dec.stop()


def test_http_streaming_chat_and_errors(ckpt, whole):
    inst = local(Layout.of([2, 4], [["a"], ["b"]], instance_id="i", model="tiny"), ckpt, http=True)
    try:
        base = inst.url
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 5,
                "stream": True, "ignore_eos": True, "return_token_ids": True, "temperature": 0}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ckpt)
        text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        assert ids == whole.greedy(tok.encode(text, add_special_tokens=False), 5)[0]
        # a client leaving mid-stream cancels its request: the scheduler forgets it, the nodes free its KV
        long = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "stream": True, "ignore_eos": True}
        assert inst.scheduler is not None
        before = inst.scheduler.batches
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=30) as r:
            next(r.iter_lines())
        for _ in range(200):
            if not inst.scheduler.active:
                break
            time.sleep(0.05)
        assert not inst.scheduler.active and inst.scheduler.batches - before < 400
        # so does a client leaving before a non-streamed answer
        before = inst.scheduler.batches
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json={**long, "stream": False, "max_tokens": 2000}, timeout=0.5)
        for _ in range(200):
            if not inst.scheduler.active:
                break
            time.sleep(0.05)
        assert not inst.scheduler.active and inst.scheduler.batches - before < 1900
        bad = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "x"})
        assert bad.status_code == 404
        bad = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5000]})
        assert bad.status_code == 400
    finally:
        inst.stop()


def test_http_admission_bound_deadline_and_node_failure(ckpt):
    """A scheduler whose nodes never come (its requests wait forever) behind the HTTP server: a deadline passed
    on arrival or while waiting is a 504, waiting requests beyond `max_waiting` a 503 with Retry-After at once,
    and a node failure ends the waiting requests with a retryable 503 and makes /health name the node."""
    from concurrent.futures import ThreadPoolExecutor

    import zmq
    from transformers import AutoTokenizer

    from coral.engine.server import DEADLINE_HEADER, Limits, create_instance_app
    from coral.http_serving import ServerThread

    sched = Scheduler(Layout.of([6], [["a"]], model="tiny"), zmq.Context.instance(), "inproc://admission-test").start()
    limits = Limits(2048, max_waiting=2, retry_after_s=3)
    srv = ServerThread(create_instance_app(sched, AutoTokenizer.from_pretrained(ckpt), 1024, "tiny", "i", limits))
    url = f"{srv.start().url}/v1/completions"
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 3}
    try:
        r = httpx.post(url, json=body, headers={DEADLINE_HEADER: str(time.time() + 0.3)}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded" and sched.waiting == 0
        r = httpx.post(url, json=body, headers={DEADLINE_HEADER: str(time.time() - 1)}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(2)]
            for _ in range(600):
                if sched.waiting == 2:
                    break
                time.sleep(0.05)
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "engine_overloaded" and r.json()["error"]["type"] == "server_error"
            sched.fail("node 0 (a, stage 0, TP rank 0, pid 1) exited with code -9")
            for f in held:
                r = f.result()
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
                assert "node 0" in r.json()["error"]["message"] and r.headers["retry-after"] == "3"
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "node 0" in health.json()["error"]["message"]
        assert httpx.post(url, json=body, timeout=60).status_code == 503 and sched.waiting == 0
    finally:
        srv.stop()
        sched.stop()


def test_http_needs_the_gateways_engine_token(ckpt):
    from coral.runtime.coral_backend import CoralEngineBackend

    token = "engine-token-0123456789"
    assert CoralEngineBackend(api_key=token).config.api_key == token  # what `coral serve --backend coral` passes
    inst = local(Layout.of([6], [["a"]], instance_id="i", model="tiny"), ckpt, http=True, api_key=token)
    try:
        base, body = inst.url, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.get(f"{base}/health").status_code == 200
        for wrong in ({}, {"Authorization": "Bearer nope"}, {"Authorization": token}):
            r = httpx.post(f"{base}/v1/completions", json=body, headers=wrong)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(f"{base}/v1/models", headers=wrong).status_code == 401
        assert httpx.get(f"{base}/openapi.json").status_code == 404
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"bearer {token}"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        inst.stop()


def test_gpu_configuration_selects_nccl_and_cuda_devices(ckpt):
    """No GPU here: check the node configurations a CUDA deployment gets (NCCL, one device per rank, the
    rendezvous given, nodes started elsewhere reachable by their own address)."""
    layout = Layout.of([2, 4], [["2xL4"], ["1xA10G", "1xL40S"]], instance_id="gpu", model="tiny")
    cfg = EngineConfig(device="cuda", dist_backend="nccl", dist_init="tcp://10.0.0.1:29500", host="0.0.0.0",
                       advertise="10.0.0.1", launch=False)
    inst = CoralInstance(layout, ckpt, cfg)
    try:
        nodes = [json.loads(argv[-1]) for argv in inst.node_commands()]
    finally:
        inst.stop()
    assert [n["device"] for n in nodes] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]  # one GPU per process
    assert [n["rank"] for n in nodes] == [0, 0, 1, 2] and {n["world_size"] for n in nodes} == {4}
    assert nodes[0]["tp_groups"] == [[0, 1]] and nodes[0]["leaders"] == [0, 2, 3]
    assert {n["dist_backend"] for n in nodes} == {"nccl"} and {n["dist_init"] for n in nodes} == {cfg.dist_init}
    assert all(n["results"].startswith("tcp://10.0.0.1:") and n["bind"] == "tcp://0.0.0.0" for n in nodes)
    assert [(n["first"], n["last"]) for n in nodes] == [(0, 2), (0, 2), (2, 6), (2, 6)]
    with pytest.raises(ValueError, match="dist_init"):
        CoralInstance(layout, ckpt, EngineConfig(launch=False)).open()


def test_gpu_engine_benchmark_runs_tiny_on_cpu(tmp_path):
    """benchmarks/gpu_engine.py at its tiny size on the CPU: the model written locally (Llama-3 shapes scaled
    down, bf16), the 2-stage pipeline exactly the whole model, a per-layer profile ProfileSet can read. The
    profile's steps are timed by the work clock (layers x tokens), so a loaded machine cannot make it too noisy
    to profile: the points are the work model's, every one kept."""
    import subprocess
    import sys
    from pathlib import Path

    from coral.perf.measured import ProfileSet
    from coral.perf.model import Phase

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_engine.py"), "--device", "cpu",
                           "--workdir", str(tmp_path / "work"), "--out", str(out), "--clock", "work"],
                          cwd=root, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "gpu_engine.json").read_text())
    assert summary["pipeline_exact_vs_whole"] and summary["config"] == "1xCPU"
    assert summary["throughput"]["pipeline"]["batched_equals_sequential"] is not None
    profiles = ProfileSet.read(out)
    assert {phase for _, phase in profiles.profiles} == {Phase.PREFILL, Phase.DECODE}
    assert all((prof.seconds > 1e-6).all() for prof in profiles.profiles.values())  # no clamped point
    rows = summary["per_layer_ms"]  # every point kept, and the work model's: 10 us per layer and token
    assert summary["profile_clock"] == "work" and {p: [b for b, _ in r] for p, r in rows.items()} == {
        "prefill": [16, 64], "decode": [1, 4]}
    assert all(ms == pytest.approx(0.01 * b) for r in rows.values() for b, ms in r)
    assert {r["config"] for r in summary["perf_model_vs_measured"]} == {"1xCPU"}
    assert all(all(exact.values()) for exact in summary["architectures_exact_vs_transformers"].values())
    assert len(summary["architectures_exact_vs_transformers"]) == 5
    # `coral perf calibrate` takes the folder as written: the manifest names a catalog model
    calibrate = subprocess.run([sys.executable, "-m", "coral.cli.main", "perf", "calibrate", str(out),
                                "--out", str(tmp_path / "params.yaml")],
                               cwd=root, capture_output=True, text=True, timeout=240)
    assert calibrate.returncode == 0, calibrate.stdout[-2000:] + calibrate.stderr[-2000:]
    assert (tmp_path / "params.yaml").exists()
