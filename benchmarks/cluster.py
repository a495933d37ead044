"""Benchmark the Coral engine on a multi-node Ray cluster on this machine against the local-process backend.

    python benchmarks/cluster.py [--rounds 2] [--duration 15] [--concurrency 4] [--max-tokens 16]

One heterogeneous PD plan (prefill `2xL40S | 1xL4`, decode `1xL4 | 1xL4 + 2xA10G`; the tiny 8-layer Llama
model, the plan's layer split scaled to it) served through the real gateway and controller:

1. Re-plan to serving: `POST /replan?wait=true` with the plan, until the answer (every instance started, healthy
   and routed) and then the first completion; on the Ray backend (a `LocalRayCluster`: one raylet per plan node,
   each advertising its node config) and on the local-process backend, rounds interleaved.
2. Data path: output tokens/s through the gateway, `--concurrency` closed-loop clients for `--duration` s
   (non-streamed completions of `--max-tokens` tokens), on the same plan on both backends, rounds interleaved;
   the best round of each is kept and their ratio reported (goal: Ray within 5 %).
3. Recovery (Ray): the plan plus a second decode instance (`1xL4 | 1xL4`) and a spare 2xA10G raylet; while
   streaming clients run, the raylet under the first decode instance's 2xA10G node is killed. Reported: time
   until the controller marks it failed, until it is serving again (re-placed on the spare), and requests lost
   before their first token (goal 0) and after it (streams cut by the dead node).

Every engine socket binds 127.0.0.1. Node processes, raylets and this driver share the machine's cores, so
figures compare the backends on the same machine, not capacity. Prints tables and writes
out/benchmarks/cluster.json.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.plan import Plan
from coral.cli.runtime import build_runtime
from coral.http_serving import ServerThread
from coral.runtime.controller import Store
from coral.runtime.coral_backend import CoralEngineBackend
from coral.runtime.handmade import make_instance, make_plan, two_gpu_catalog
from coral.runtime.ray_backend import LocalRayCluster, RayCoralBackend

PREFILL = make_instance("phi-4", "prefill", [(24, ["2xL40S"]), (16, ["1xL4"])], 6000.0, template_id=1)
DECODE = make_instance("phi-4", "decode", [(16, ["1xL4"]), (24, ["1xL4", "2xA10G"])], 500.0, template_id=2)
DECODE_B = make_instance("phi-4", "decode", [(20, ["1xL4"]), (20, ["1xL4"])], 500.0, template_id=3)
PLAN = make_plan([PREFILL, DECODE])
RAYLETS = Counter({"2xL40S": 1, "1xL4": 5, "2xA10G": 2})  # the plan, a second decode instance and a spare
PROMPT = [11, 52, 300, 7, 8, 9, 10, 11]


class Served:
    """Gateway + controller on the backend `make(engine token)` returns; plans posted to `/replan`."""

    def __init__(self, make: Callable[[str], CoralEngineBackend], db: Path) -> None:
        store = Store(db)
        backend = self.backend = make(store.engine_token())
        app, self.controller = build_runtime(lambda: PLAN, store, backend, 3600.0, ready_timeout_s=300,
                                             catalog=two_gpu_catalog)
        self.controller.retry_s = 0.5
        self.server = ServerThread(app).start()
        self.url = self.server.url

    def replan(self, plan: Plan) -> float:
        """Seconds from POST /replan?wait=true to the first completion answered."""
        t0 = time.perf_counter()
        r = httpx.post(f"{self.url}/replan?wait=true", content=plan.model_dump_json(), timeout=600)
        r.raise_for_status()
        self.complete(1)
        return time.perf_counter() - t0

    def complete(self, max_tokens: int) -> int:
        body = {"model": "phi-4", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    def throughput(self, concurrency: int, duration_s: float, max_tokens: int) -> float:
        """Output tokens/s of `concurrency` closed-loop clients over `duration_s`."""
        end = time.perf_counter() + duration_s

        def client() -> int:
            tokens = 0
            while time.perf_counter() < end:
                tokens += self.complete(max_tokens)
            return tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            total = sum(pool.map(lambda _: client(), range(concurrency)))
        return total / (time.perf_counter() - t0)

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/state", timeout=10).json()

    def close(self) -> None:
        self.controller.stop()
        self.server.stop(force=True)
        self.backend.close()


def stream_once(url: str, max_tokens: int) -> str:
    """One streamed completion: 'ok', 'lost-before-first-token' or 'lost-after-first-token'."""
    body = {"model": "phi-4", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    got_token = False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return "lost-before-first-token"
            for line in r.iter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    return "lost-after-first-token" if got_token else "lost-before-first-token"
                if line.startswith("data: {"):
                    got_token = True
                if line == "data: [DONE]":
                    return "ok"
    except httpx.HTTPError:
        pass
    return "lost-after-first-token" if got_token else "lost-before-first-token"


def recovery(served: Served, cluster: LocalRayCluster, clients: int, max_tokens: int) -> dict[str, Any]:
    """Kill the raylet under DECODE's 2xA10G node while `clients` stream; time to failed and to serving again."""
    assert isinstance(served.backend, RayCoralBackend)
    served.replan(make_plan([PREFILL, DECODE, DECODE_B]))
    placed = served.backend.placed[DECODE.id]
    a10g_node = placed.handle["ray_nodes"][-1]
    (victim,) = [n for n in cluster.raylets["2xA10G"] if n.node_id == a10g_node]
    outcomes: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            outcome = stream_once(served.url, max_tokens)
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    t0 = time.perf_counter()
    cluster.kill(victim)
    failed_s = ready_s = None
    while time.perf_counter() - t0 < 180 and ready_s is None:
        st = {i["id"]: i["state"] for i in served.state()["instances"]}
        if failed_s is None and st.get(DECODE.id) in ("failed", "starting"):
            failed_s = time.perf_counter() - t0
        if failed_s is not None and st.get(DECODE.id) == "ready":
            ready_s = time.perf_counter() - t0
        time.sleep(0.1)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(180)
    return {"failed_s": failed_s, "serving_again_s": ready_s, "requests": sum(outcomes.values()),
            "lost_before_first_token": outcomes["lost-before-first-token"],
            "lost_after_first_token": outcomes["lost-after-first-token"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = table_console()
    tmp = Path(tempfile.mkdtemp(prefix="coral-cluster-bench-"))
    cache = tmp / "cache"
    t0 = time.perf_counter()
    cluster = LocalRayCluster(RAYLETS)
    cluster_s = time.perf_counter() - t0
    rows: dict[str, dict[str, list[float]]] = {"local": {"replan_s": [], "tokens_s": []},
                                               "ray": {"replan_s": [], "tokens_s": []}}
    result: dict[str, Any] = {"plan": [PREFILL.id, DECODE.id], "cluster_start_s": cluster_s, **vars(args)}
    result["out"] = str(args.out)
    try:
        for _ in range(args.rounds):
            for name in ("local", "ray"):
                def make(token: str, name: str = name) -> CoralEngineBackend:
                    if name == "ray":
                        return RayCoralBackend(cache_dir=cache, api_key=token, address=cluster.address,
                                               host="127.0.0.1", place_timeout_s=30)
                    return CoralEngineBackend(cache_dir=cache, api_key=token)

                served = Served(make, tmp / f"{name}-{len(rows[name]['replan_s'])}.sqlite")
                try:
                    rows[name]["replan_s"].append(served.replan(PLAN))
                    rows[name]["tokens_s"].append(served.throughput(args.concurrency, args.duration, args.max_tokens))
                    console.print(f"{name}: re-plan to serving {rows[name]['replan_s'][-1]:.2f} s, "
                                  f"{rows[name]['tokens_s'][-1]:.1f} tokens/s")
                    if isinstance(served.backend, RayCoralBackend) and "recovery" not in result:
                        served.backend.on_change = lambda s=served: s.controller.trigger(plan=False)
                        served.controller.start()
                        result["recovery"] = recovery(served, cluster, args.concurrency, args.max_tokens)
                finally:
                    served.close()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    for name, r in rows.items():
        result[name] = {"replan_s": r["replan_s"], "tokens_s": r["tokens_s"],
                        "best_replan_s": min(r["replan_s"]), "best_tokens_s": max(r["tokens_s"])}
    result["ray_vs_local_tokens"] = result["ray"]["best_tokens_s"] / result["local"]["best_tokens_s"]
    table = Table("backend", "re-plan to serving (best)", "output tokens/s (best)", "rounds",
                  title=f"Heterogeneous PD plan, {args.concurrency} clients x {args.max_tokens} tokens")
    for name in ("local", "ray"):
        r = result[name]
        table.add_row(name, f"{r['best_replan_s']:.2f} s", f"{r['best_tokens_s']:.1f}",
                      ", ".join(f"{a:.1f} s / {b:.0f}" for a, b in zip(r["replan_s"], r["tokens_s"], strict=True)))
    console.print(table)
    console.print(f"Ray / local output tokens/s: {result['ray_vs_local_tokens']:.3f}")
    rec = result.get("recovery", {})
    t = Table("marked failed", "serving again", "requests", "lost before first token", "lost after first token",
              title="A raylet killed under a decode instance (spare raylet present)")
    t.add_row(*(f"{rec[k]:.2f} s" if rec.get(k) is not None else "-" for k in ("failed_s", "serving_again_s")),
              str(rec.get("requests")), str(rec.get("lost_before_first_token")), str(rec.get("lost_after_first_token")))
    console.print(t)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cluster.json"
    path.write_text(stamped_json(result, indent=2, default=str))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
