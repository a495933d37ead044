"""Shedding at the planned share on `coral serve --backend emulated`: held-out goodput after a GPU type is lost.

    python benchmarks/shedding_runtime.py [--scenario core] [--lose L40S] [--time-scale 2] [--before 5]
        [--after 20] [--seed 1] [--max-output 256]

`coral serve SCENARIO --backend emulated --plan PLAN` (in this process: its `build_runtime`) serves the
allocator's cost plan for the scenario (its template library, `coral templates build`); open-loop streamed completions replay the scenario's
held-out requests (workload seed `--seed`; output tokens capped at `--max-output` so each answer ends within the
run), in slowed time: every arrival, every engine delay and the gateway's shedding buckets x `--time-scale`
(`coral serve --time-scale`), so the same queues form at 1/`--time-scale` of the events per second, and the SLOs
are judged x `--time-scale`. After
`--before` s of scenario time every node of the GPU type `--lose` is lost: the goodput-mode plan within the nodes
the running plan held, less that GPU type, is posted to `/replan` (`allocate(..., mode="goodput",
availability=...)`), and the instances on that GPU type crash. Two runs on the same requests: `--shed plan` (the
gateway refuses each model's requests beyond its capacity at once while the plan in force serves a model only in
part, or a model lost instances: `coral.allocation.shedding`) and `--shed off`. Per model, over the requests arriving after the loss: sent, answered within both SLOs (TTFT and TPOT
of the streamed answer), shed (429 `model_over_capacity`), other errors, and SLO goodput (output tokens/s of the
requests within both SLOs, per second of scenario time). The same requests and loss are then simulated, both
arms (`simulated`), for a second table. Prints the tables and writes `--json` (default
out/benchmarks/shedding_runtime.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.allocator import allocate
from coral.allocation.plan import Plan
from coral.allocation.shedding import Shedder, sheds
from coral.catalog.loader import load_scenario
from coral.catalog.schema import AvailabilitySchedule, AvailabilityStep, Scenario
from coral.cli.runtime import build_runtime, prefill_timeouts, token_timeouts
from coral.http_serving import ServerThread
from coral.runtime.backends import EmulatedBackend
from coral.runtime.controller import Controller, Store
from coral.runtime.gateway import GatewayConfig
from coral.runtime.gateway.config import ShedMode
from coral.simulation import simulate
from coral.templates.store import load_library
from coral.workload.traces import RequestSet, workload_for

Request = tuple[float, str, int, int]
"""(arrival s of scenario time, model, prompt tokens, output tokens)"""


def held_nodes(plan: Plan) -> dict[str, dict[str, int]]:
    """Nodes per region and config that `plan`'s instances hold."""
    out: dict[str, dict[str, int]] = {}
    for inst in plan.instances:
        for cfg, n in inst.counts.items():
            out.setdefault(inst.region, {})[cfg] = out.get(inst.region, {}).get(cfg, 0) + n
    return out


def without_gpu(nodes: dict[str, dict[str, int]], gpu: str) -> dict[str, dict[str, int]]:
    """`nodes` less every config of GPU type `gpu` (configs are named `<count>x<GPU>`)."""
    return {r: {c: n for c, n in cfgs.items() if c.partition("x")[2] != gpu} for r, cfgs in nodes.items()}


def requests_of(sc: Scenario, duration_s: float, seed: int, max_output: int) -> list[Request]:
    """The scenario's held-out requests over `duration_s`, by arrival."""
    out = []
    for model, rs in workload_for(sc, duration_s, seed, part="held_out").items():
        for t, i, o in zip(rs.arrival_s, rs.input_tokens, rs.output_tokens, strict=True):
            out.append((float(t), model, max(1, int(i)), max(1, min(max_output, int(o)))))
    return sorted(out)


def request_sets(requests: list[Request]) -> dict[str, RequestSet]:
    """`requests` as the simulator takes them, per model."""
    out: dict[str, RequestSet] = {}
    for model in sorted({r[1] for r in requests}):
        rs = [r for r in requests if r[1] == model]
        out[model] = RequestSet(np.array([r[0] for r in rs]), np.array([r[2] for r in rs]),
                                np.array([r[3] for r in rs]))
    return out


def simulated(sc: Scenario, plan: Plan, requests: list[Request], shed: ShedMode,
              loss: tuple[float, str, Plan]) -> list[dict[str, Any]]:
    """The same requests and loss in the simulator (`coral.simulation.simulate`): `plan` until the loss, when an
    availability step takes every node of the GPU type (its instances are lost at once) and the loss plan is in
    force (instances ready at once, as the emulated ones nearly are); records as `one` makes them (the simulator's
    TTFT ends at the prefill, its TPOT holds the KV hand-off and the decode admission)."""
    at_s, gpu, loss_plan = loss
    gone = {r: {c: 0 for c in cfgs if c.partition("x")[2] == gpu} for r, cfgs in held_nodes(plan).items()}
    schedule = AvailabilitySchedule(steps=[AvailabilityStep(at_s=at_s, counts=gone)])
    end = max(r[0] for r in requests) + 1e-3
    res = simulate(lambda epoch, _demand, _running: plan if epoch == 0 else loss_plan, sc, request_sets(requests),
                   duration_s=end, epoch_s=at_s, startup_delay_s=0.0, availability=schedule, shed=shed)
    pr = res.per_request()
    names = [m.model for m in res.models]
    out = []
    for k in range(len(pr["arrival_s"])):
        ttft, tpot = float(pr["ttft_s"][k]), float(pr["tpot_s"][k])
        outcome = ("shed" if pr["refused"][k] else "answered" if np.isfinite(ttft) and np.isfinite(tpot)
                   else "unfinished")
        out.append({"arrival_s": float(pr["arrival_s"][k]), "model": names[int(pr["model"][k])],
                    "output_tokens": int(pr["output_tokens"][k]), "ttft_s": ttft, "tpot_s": tpot, "outcome": outcome})
    return out


@contextmanager
def serving(sc: Scenario, plan: Plan, shed: ShedMode, time_scale: float, work: Path) -> Iterator[Serving]:
    """`coral serve SCENARIO --backend emulated --plan PLAN --time-scale K --shed SHED` in this process (its
    `build_runtime`, gateway config and shedder), until every instance is ready."""
    store = Store(work / f"{shed}.sqlite")
    engines = EmulatedBackend(time_scale=time_scale, scenario=sc, api_key=store.engine_token())
    scale = max(1.0, time_scale)
    config = GatewayConfig(prefill_timeout_s=prefill_timeouts(sc, 10 * scale),
                           token_timeout_s=token_timeouts(sc, 10 * scale), shed=shed)
    app, controller = build_runtime(lambda: plan, store, engines, 3600.0, config, scenario=sc,
                                    shedder=Shedder.for_scenario(sc, time_scale))
    server = ServerThread(app).start()
    controller.start()
    try:
        deadline = time.monotonic() + 120
        while len(controller.registry.all()) < len(plan.instances) or not all(
                e.routable for e in controller.registry.all()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"instances not ready: {controller.state()['actions'][:3]}")
            time.sleep(0.1)
        yield Serving(server.url, controller, engines, plan)
    finally:
        server.stop()
        controller.stop()
        engines.close()


@dataclass
class Serving:
    url: str
    controller: Controller
    engines: EmulatedBackend
    plan: Plan
    """the plan served before the loss"""

    def lose(self, gpu: str) -> list[str]:
        """Crash every instance on a node of `gpu` (its nodes are gone: open connections dropped); their ids."""
        lost = [i.id for i in self.plan.instances if any(c.partition("x")[2] == gpu for c in i.counts)]
        for iid in lost:
            self.engines.kill(iid)
        return lost


async def one(client: httpx.AsyncClient, url: str, req: Request, k: float) -> dict[str, Any]:
    """Send one streamed completion at its arrival (x `k`); its status, TTFT, TPOT and latency to its last token
    (scenario seconds)."""
    arrival, model, prompt, output = req
    body = {"model": model, "prompt": "abc " * prompt, "max_tokens": output, "stream": True}
    sent = time.perf_counter()
    rec: dict[str, Any] = {"arrival_s": arrival, "model": model, "output_tokens": output, "ttft_s": None,
                           "tpot_s": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                code = (json.loads(raw).get("error") or {}).get("code") if raw.startswith(b"{") else None
                rec["outcome"] = "shed" if code == "model_over_capacity" else f"http {r.status_code} {code}"
                return rec
            first = last = None
            tokens = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["outcome"] = f"stream error {event['error'].get('code')}"
                    return rec
                if any(c.get("text") for c in event.get("choices") or []):
                    last = time.perf_counter()
                    first = first or last
                    tokens += 1
    except httpx.HTTPError as exc:
        rec["outcome"] = type(exc).__name__
        return rec
    if first is None or last is None:
        rec["outcome"] = "no tokens"
        return rec
    rec["ttft_s"] = (first - sent) / k
    rec["tpot_s"] = (last - first) / (tokens - 1) / k if tokens > 1 else 0.0
    rec["latency_s"] = (last - sent) / k
    rec["outcome"] = "answered"
    return rec


async def replay(srv: Serving, requests: list[Request], k: float,
                 loss: tuple[float, str, Plan] | None = None) -> list[dict[str, Any]]:
    """Open-loop replay of `requests` in time slowed by `k`; with `loss` (at s, GPU type, plan), the plan is posted
    to `/replan` at that time and the instances on that GPU type crash."""
    url = srv.url
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        t0 = time.perf_counter()

        async def at(req: Request) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + req[0] * k - time.perf_counter()))
            return await one(client, url, req, k)

        async def lose(at_s: float, gpu: str, plan: Plan) -> None:
            await asyncio.sleep(at_s * k)
            r = await client.post(f"{url}/replan", content=plan.model_dump_json())
            r.raise_for_status()
            await asyncio.to_thread(srv.lose, gpu)

        lost = asyncio.create_task(lose(*loss)) if loss is not None else None
        records = await asyncio.gather(*(at(r) for r in requests))
        if lost is not None:
            await lost
        return list(records)


def summarize(records: list[dict[str, Any]], sc: Scenario, loss_at_s: float, end_s: float) -> dict[str, dict[str, Any]]:
    """Per model and for all, over the requests arriving after the loss: sent, within both SLOs, shed, other
    errors (by kind), SLO goodput (output tokens/s of scenario time of the requests within both SLOs)."""
    slo = {m.model: (m.prefill_slo_ms / 1e3, m.decode_slo_ms / 1e3) for m in sc.models}
    out: dict[str, dict[str, Any]] = {}
    for name in [*slo, "all"]:
        late = [r for r in records if r["arrival_s"] >= loss_at_s and name in (r["model"], "all")]
        good = [r for r in late if r["outcome"] == "answered" and r["ttft_s"] <= slo[r["model"]][0]
                and r["tpot_s"] <= slo[r["model"]][1]]
        errors: dict[str, int] = {}
        for r in late:
            if r["outcome"] not in ("answered", "shed"):
                errors[r["outcome"]] = errors.get(r["outcome"], 0) + 1
        out[name] = {"sent": len(late), "within_slo": len(good), "shed": sum(r["outcome"] == "shed" for r in late),
                     "late": sum(r["outcome"] == "answered" for r in late) - len(good),
                     "errors": sum(errors.values()), "error_kinds": errors,
                     "goodput_tokens_s": sum(r["output_tokens"] for r in good) / (end_s - loss_at_s)}
    return out


def replay_options(doc: str, json_default: str) -> argparse.ArgumentParser:
    """The options of a benchmark replaying held-out requests on `coral serve --backend emulated`."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--scenario", default="core")
    ap.add_argument("--time-scale", type=float, default=2.0, help="wall seconds per scenario second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-output", type=int, default=256, help="output tokens of a request at most")
    ap.add_argument("--json", type=Path, default=Path(json_default))
    return ap


def main() -> None:
    ap = replay_options(__doc__, "out/benchmarks/shedding_runtime.json")
    ap.add_argument("--lose", default="L40S", help="GPU type lost: every node config of it")
    ap.add_argument("--before", type=float, default=5.0, help="scenario seconds before the loss")
    ap.add_argument("--after", type=float, default=20.0, help="scenario seconds of requests after the loss")
    args = ap.parse_args()

    started = time.perf_counter()
    sc = load_scenario(args.scenario)
    lib = load_library(args.scenario, Path("out"))
    plan = allocate(lib, sc)
    left = without_gpu(held_nodes(plan), args.lose)
    loss_plan = allocate(lib, sc, mode="goodput", availability=left, running=plan)
    if not sheds(loss_plan):
        raise SystemExit(f"the plan without {args.lose} serves every model in full: nothing to shed")
    end_s = args.before + args.after
    requests = requests_of(sc, end_s, args.seed, args.max_output)
    k = args.time_scale
    runs: dict[str, Any] = {}
    arms: tuple[ShedMode, ...] = ("plan", "off")
    with tempfile.TemporaryDirectory() as tmp:
        for shed in arms:
            t0 = time.perf_counter()
            with serving(sc, plan, shed, k, Path(tmp)) as srv:
                records = asyncio.run(replay(srv, requests, k, (args.before, args.lose, loss_plan)))
            runs[shed] = {"after_loss": summarize(records, sc, args.before, end_s), "wall_s": time.perf_counter() - t0}
    sims = {shed: {"after_loss": summarize(simulated(sc, plan, requests, shed, (args.before, args.lose, loss_plan)),
                                           sc, args.before, end_s)} for shed in arms}

    console = table_console()
    share = ", ".join(f"{s.model}/{s.phase} {s.served_fraction:.0%}" for s in loss_plan.serving)
    for side, results in ((f"coral serve --backend emulated (time x{k:g})", runs),
                          ("the simulator, same requests and loss", sims)):
        table = Table(title=f"{sc.name} on {side}: every {args.lose} node lost at {args.before:g} s; requests "
                            f"arriving in the {args.after:g} s after (held-out, seed {args.seed}); the plan after "
                            f"serves {share}")
        cols = ["model", "sent"] + [f"{arm}: {c}" for arm in ("shed", "no shedding")
                                    for c in ("within SLO", "shed", "late", "errors", "goodput tok/s")]
        for col in cols:
            table.add_column(col, justify="left" if col == "model" else "right")
        for name in [*(m.model for m in sc.models), "all"]:
            row = [name, f"{results['plan']['after_loss'][name]['sent']:,}"]
            for arm in arms:
                a = results[arm]["after_loss"][name]
                row += [f"{a['within_slo']:,}", f"{a['shed']:,}", f"{a['late']:,}", f"{a['errors']:,}",
                        f"{a['goodput_tokens_s']:,.0f}"]
            table.add_row(*row)
        console.print(table)
    for arm, run in runs.items():
        kinds = {k2: v for name, a in run["after_loss"].items() if name == "all" for k2, v in a["error_kinds"].items()}
        console.print(f"emulated, --shed {arm}: {run['wall_s']:.0f} s; other errors: {kinds or 'none'}")
    wall = time.perf_counter() - started
    console.print(f"wall time {wall:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_json({"scenario": sc.name, "lose": args.lose, "time_scale": k, "before_s": args.before,
                                     "after_s": args.after, "seed": args.seed, "max_output": args.max_output,
                                     "plan_after_loss": {f"{s.model}/{s.phase}": s.served_fraction
                                                         for s in loss_plan.serving},
                                     "runs": runs, "simulated": sims, "wall_s": wall}, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
