"""Load and node-kill benchmark of `coral serve --backend coral` on this machine (issue 30): the gateway, the
controller and a one-instance PD plan of the Coral engine (one prefill and one decode instance, one node
process each, the tiny model standing in for phi-4), run as `coral serve` runs them, in a subprocess, with
the core scenario's SLO timeouts (`--slo-timeout`, 10 x by default, as `coral serve`).

(a) Load: `--requests` completions sent at once (prompts of 4 to 2,030 token ids from a seeded RNG, half streamed,
    `--max-tokens` each with `ignore_eos`). Each request is answered (status 200 and the whole answer: every
    token, no error), refused (a non-200 status with an OpenAI error: its status and code name the reason), cut
    (a stream ended by a named SSE error), or a failure (anything else: no error body, an incomplete answer, a
    dropped connection, no answer within `--client-timeout`). Also: streams whose first token took over 60 s,
    ejections (done, and held back by the ejection cap), and whether a pool was ever emptied by ejection
    (sampled from /gateway/state: every instance of a pool out of routing, healthy, with an ejection on record).
(b) Node kill: `--streams` long streams in flight, then SIGKILL of the decode instance's node process, then as many
    new requests (half streamed). Each is completed, failed with a retryable named error (429/502/503/504 with
    an OpenAI error, or a stream ended by a named SSE error), hung (no outcome within `--client-timeout`), or
    another failure. Also: seconds from the kill until the gateway stopped routing to the instance, until the
    controller recorded it lost, and until the decode instance served again.

Prints two tables and writes out/benchmarks/engine_load.json.

    .venv/bin/python benchmarks/engine_load.py [--quick] [--seed 0] [--requests 200] [--slo-timeout 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.console import Console
from rich.table import Table

from coral.http_serving import free_port
from coral.runtime.handmade import make_instance, make_plan

OUT = Path("out/benchmarks/engine_load.json")
MODEL = "phi-4"
PROMPT_TOKENS = (4, 2030)
RETRYABLE = (429, 502, 503, 504)
VOCAB = 500
"""Prompt token ids are drawn below this (every tiny model's vocabulary is larger)."""


@dataclass
class Outcome:
    kind: str
    """answered | refused | cut | failed | hung"""
    reason: str = ""
    """what names it: 'STATUS code' of a refusal, 'stream error code' of a cut, else a description"""
    message: str = ""
    """the error's message, when there is one"""
    streamed: bool = False
    first_token_s: float | None = None
    seconds: float = 0.0


@dataclass
class Serve:
    """A running `coral serve --backend coral` subprocess."""

    url: str
    db: Path
    proc: subprocess.Popen[bytes]
    decode_id: str
    log: Path

    def state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/state", timeout=10).json()

    def gateway_state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/gateway/state", timeout=10).json()

    def metric(self, name: str) -> float:
        """Sum of a counter over its labels, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(f"{name}_total"))

    def node_pids(self, instance_id: str) -> list[int]:
        """Node process ids of a running instance, from the controller's state database."""
        with sqlite3.connect(self.db) as db:
            row = db.execute("SELECT handle FROM observed WHERE id=?", (instance_id,)).fetchone()
        return list(json.loads(row[0]).get("pids", [])) if row else []

    def ready(self) -> int:
        try:
            return sum(i["state"] == "ready" and i["healthy"] for i in self.state()["instances"])
        except (httpx.HTTPError, ValueError):
            return 0


@contextmanager
def serve(tmp: Path, slo_timeout: float, start_timeout_s: float) -> Iterator[Serve]:
    """`coral serve core --backend coral` on a one-instance PD plan of phi-4, on loopback, once both are ready."""
    plan = make_plan([
        make_instance(MODEL, "prefill", [(40, ["1xL4"])], 6000.0, template_id=1),
        make_instance(MODEL, "decode", [(40, ["1xL4"])], 500.0, template_id=2),
    ])
    port = free_port()
    db, log = tmp / "serve.sqlite", tmp / "serve.log"
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--plan", str(plan.save(tmp / "plan.json")),
           "--backend", "coral", "--port", str(port), "--db", str(db), "--slo-timeout", str(slo_timeout)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    s = Serve(f"http://127.0.0.1:{port}", db, proc, plan.instances[1].id, log)
    try:
        deadline = time.monotonic() + start_timeout_s
        while s.ready() < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coral serve did not get both instances ready; see {log}")
            time.sleep(0.5)
        yield s
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def error_of(raw: bytes | str) -> tuple[str, str] | None:
    """(code, message) of an OpenAI-shaped error body (`code`, else `type`), else None."""
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or err.get("type")), str(err["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, stream: bool,
                  timeout_s: float) -> Outcome:
    """Send one completion; classify what came back."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    out = Outcome("failed", "no answer", streamed=stream)
    try:
        async with asyncio.timeout(timeout_s):
            if not stream:
                r = await client.post(f"{url}/v1/completions", json=body)
                out = classify(r.status_code, r.content, stream)
            else:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        out = classify(r.status_code, await r.aread(), stream)
                    else:
                        out = await read_stream(r, max_tokens, start)
    except TimeoutError:
        out = Outcome("hung", f"no outcome within {timeout_s:g} s", streamed=stream)
    except httpx.HTTPError as exc:
        out = Outcome("failed", f"connection: {type(exc).__name__}", streamed=stream)
    out.seconds = time.perf_counter() - start
    return out


def classify(status: int, raw: bytes, stream: bool) -> Outcome:
    if status == 200:
        try:
            doc = json.loads(raw)
            done = doc["choices"][0]["finish_reason"] is not None
            return Outcome("answered" if done else "failed", "" if done else "no finish_reason", streamed=stream)
        except (ValueError, KeyError, IndexError, TypeError):
            return Outcome("failed", "200 without a completion", streamed=stream)
    if (err := error_of(raw)) is None:
        return Outcome("failed", f"{status} without an error body", streamed=stream)
    return Outcome("refused", f"{status} {err[0]}", err[1], stream)


async def read_stream(r: httpx.Response, max_tokens: int, start: float) -> Outcome:
    first: float | None = None
    tokens, done, event = None, False, ""
    async for line in r.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        if (err := error_of(data)) is not None or event == "error":
            code, message = err or ("unnamed", data[:200])
            return Outcome("cut", f"stream error {code}", message, True, first)
        doc = json.loads(data)
        if first is None and any(c.get("text") for c in doc.get("choices") or []):
            first = time.perf_counter() - start
        if doc.get("usage"):
            tokens = doc["usage"].get("completion_tokens")
    if done and tokens == max_tokens:
        return Outcome("answered", streamed=True, first_token_s=first)
    why = f"stream ended without its answer ([DONE]: {done}, tokens: {tokens})"
    return Outcome("failed", why, streamed=True, first_token_s=first)


def pool_emptied(gw_state: dict[str, Any]) -> list[str]:
    """Pools ('model/phase') whose every instance is out of routing, healthy and ready, with an ejection on record."""
    pools: dict[str, list[dict[str, Any]]] = {}
    for i in gw_state["instances"]:
        pools.setdefault(f"{i['model']}/{i['phase']}", []).append(i)
    return [p for p, eps in pools.items() if eps and all(
        e["target_share"] == 0 and e["healthy"] and e["state"] == "ready" and e["ejections"] > 0 for e in eps)]


class Sampler:
    """Samples /gateway/state every `every_s` in a thread: pools emptied by ejection."""

    def __init__(self, s: Serve, every_s: float = 0.25) -> None:
        self.s, self.every_s = s, every_s
        self.emptied: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            with suppress(httpx.HTTPError, ValueError):
                self.emptied |= set(pool_emptied(self.s.gateway_state()))

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(10)


def reasons(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per reason of the outcomes not answered ('kind: reason'): their count and one message."""
    out: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        if o.kind != "answered":
            row = out.setdefault(f"{o.kind}: {o.reason}", {"count": 0, "example": o.message[:160]})
            row["count"] += 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["count"]))


def tally(outcomes: list[Outcome]) -> dict[str, Any]:
    kinds = Counter(o.kind for o in outcomes)
    return {"count": len(outcomes), **{k: kinds.get(k, 0) for k in ("answered", "refused", "cut", "failed", "hung")},
            "reasons": reasons(outcomes)}


async def load(s: Serve, n: int, max_tokens: int, seed: int, timeout_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    reqs = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(*PROMPT_TOKENS))], k % 2 == 1) for k in range(n)]
    before = {m: s.metric(m) for m in ("coral_gateway_ejections", "coral_gateway_ejections_capped")}
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    start = time.perf_counter()
    with Sampler(s) as sampler:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
            outs = await asyncio.gather(*(request(client, s.url, p, max_tokens, st, timeout_s) for p, st in reqs))
    wall = time.perf_counter() - start
    return {
        **tally(list(outs)),
        "wall_s": wall,
        "streams_first_token_over_60s": sum(o.streamed and (o.first_token_s or o.seconds) > 60 for o in outs),
        "ejections": s.metric("coral_gateway_ejections") - before["coral_gateway_ejections"],
        "ejections_capped": s.metric("coral_gateway_ejections_capped") - before["coral_gateway_ejections_capped"],
        "pools_emptied_by_ejection": sorted(sampler.emptied),
        "outcomes": [asdict(o) for o in outs],
    }


def named_retryable(o: Outcome) -> bool:
    return o.kind == "cut" or (o.kind == "refused" and int(o.reason.split(" ", 1)[0]) in RETRYABLE)


def kill_tally(outs: list[Outcome]) -> dict[str, Any]:
    return {
        "count": len(outs),
        "completed": sum(o.kind == "answered" for o in outs),
        "retryable_named_error": sum(named_retryable(o) for o in outs),
        "hung": sum(o.kind == "hung" for o in outs),
        "other_failure": sum(o.kind != "answered" and not named_retryable(o) and o.kind != "hung" for o in outs),
        "reasons": reasons(outs),
    }


async def node_kill(s: Serve, streams: int, seed: int, timeout_s: float) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 64))] for _ in range(2 * streams)]
    pids = s.node_pids(s.decode_id)
    limits = httpx.Limits(max_connections=4 * streams, max_keepalive_connections=4 * streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        started = time.perf_counter()
        inflight = [asyncio.create_task(request(client, s.url, p, 1500, True, timeout_s)) for p in prompts[:streams]]
        while sum(i["inflight"] for i in s.gateway_state()["instances"] if i["id"] == s.decode_id) < streams:
            if time.perf_counter() - started > timeout_s or all(t.done() for t in inflight):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the streams are producing tokens
        killed_at = time.time()
        os.kill(pids[0], signal.SIGKILL)
        later = [asyncio.create_task(request(client, s.url, p, 16, k % 2 == 1, timeout_s))
                 for k, p in enumerate(prompts[streams:])]
        out_of_routing = noticed = back = None
        why = ""
        while time.time() - killed_at < timeout_s and (noticed is None or back is None or out_of_routing is None):
            now = time.time() - killed_at
            try:
                gw = {i["id"]: i for i in s.gateway_state()["instances"]}
                st = s.state()
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(0.05)
                continue
            dec = gw.get(s.decode_id)
            if out_of_routing is None and (dec is None or not dec["healthy"] or dec["target_share"] == 0):
                out_of_routing = now
            lost = [a for a in st["actions"] if a["kind"] == "lost" and a["instance_id"] == s.decode_id
                    and a["ts"] >= killed_at]
            if noticed is None and lost:
                noticed, why = lost[-1]["ts"] - killed_at, lost[-1]["detail"]
            if noticed is not None and back is None and dec is not None and dec["healthy"] and dec["target_share"] > 0:
                back = now
            await asyncio.sleep(0.05)
        first = list(await asyncio.gather(*inflight))
        second = list(await asyncio.gather(*later))
    return {
        "killed_pid": pids[0],
        "inflight": kill_tally(first),
        "later": kill_tally(second),
        "gateway_stopped_routing_s": out_of_routing,
        "controller_noticed_s": noticed,
        "controller_reason": why,
        "decode_back_s": back,
        "outcomes": {"inflight": [asdict(o) for o in first], "later": [asdict(o) for o in second]},
    }


def seconds(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def show(console: Console, a: dict[str, Any], b: dict[str, Any], args: argparse.Namespace) -> None:
    t = Table(title=f"(a) {a['count']} requests at once (prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, "
                    f"half streamed, max_tokens {args.max_tokens}), slo-timeout {args.slo_timeout:g}")
    t.add_column("outcome")
    t.add_column("requests", justify="right")
    for k in ("answered", "refused", "cut", "failed", "hung"):
        t.add_row(k, str(a[k]))
    for reason, row in a["reasons"].items():
        t.add_row(f"  {reason} (e.g. {row['example'][:90]})", str(row["count"]))
    t.add_row("streams with first token > 60 s", str(a["streams_first_token_over_60s"]))
    t.add_row("ejections / held back by the cap", f"{a['ejections']:.0f} / {a['ejections_capped']:.0f}")
    t.add_row("pool emptied by ejection", ", ".join(a["pools_emptied_by_ejection"]) or "no")
    t.add_row("wall time", f"{a['wall_s']:.1f} s")
    console.print(t)
    kt = Table(title=f"(b) SIGKILL of the decode instance's node process, {b['inflight']['count']} streams in flight")
    kt.add_column("")
    kt.add_column("in-flight streams", justify="right")
    kt.add_column("requests after the kill", justify="right")
    for key in ("completed", "retryable_named_error", "hung", "other_failure"):
        kt.add_row(key.replace("_", " "), str(b["inflight"][key]), str(b["later"][key]))
    for reason in sorted(set(b["inflight"]["reasons"]) | set(b["later"]["reasons"])):
        rows = [b[g]["reasons"].get(reason, {}) for g in ("inflight", "later")]
        example = next(r["example"] for r in rows if r)[:90]
        kt.add_row(f"  {reason} (e.g. {example})", *(str(r.get("count", 0)) for r in rows))
    kt.add_row("gateway stopped routing to it", seconds(b["gateway_stopped_routing_s"]), "")
    kt.add_row("controller recorded it lost", seconds(b["controller_noticed_s"]), "")
    kt.add_row(f"  its reason: {b['controller_reason'][:90]}", "", "")
    kt.add_row("decode instance serving again", seconds(b["decode_back_s"]), "")
    console.print(kt)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 requests, 6 streams killed")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-timeout", type=float, default=10.0, help="coral serve's --slo-timeout")
    p.add_argument("--client-timeout", type=float, default=180.0, help="seconds before a request counts as hung")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args()
    if args.quick:
        args.requests, args.streams = 40, 6
    console = table_console()
    with tempfile.TemporaryDirectory(prefix="coral-engine-load-") as tmp, \
            serve(Path(tmp), args.slo_timeout, args.start_timeout) as s:
        a = asyncio.run(load(s, args.requests, args.max_tokens, args.seed, args.client_timeout))
        deadline = time.monotonic() + args.start_timeout
        while s.ready() < 2 and time.monotonic() < deadline:  # both instances back in routing
            time.sleep(0.5)
        b = asyncio.run(node_kill(s, args.streams, args.seed, args.client_timeout))
    show(console, a, b, args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(stamped_json({"args": vars(args), "load": a, "node_kill": b}, indent=1, default=str))
    console.print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
