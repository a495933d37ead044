"""The emulated runtime against the simulator: one plan, the same requests, per model.

    python benchmarks/emulated_fidelity.py [--scenario core] [--duration 30] [--time-scale 2] [--seed 1]
        [--max-output 256] [--json out/benchmarks/emulated_fidelity.json]

Serves the allocator's cost plan for the scenario on `coral serve --backend emulated` (in this process, as
`benchmarks/shedding_runtime.py` does: real gateway and engine servers on loopback, time slowed by `--time-scale`)
with the scenario's held-out requests of the first `--duration` s (workload seed `--seed`, outputs capped at
`--max-output`), and simulates the same plan on the same requests (`coral.simulation.simulate`, instances ready
at 0, no shedding). Per model: SLO attainment (TTFT, TPOT, both) on each side, and per request the latency to
the last token, emulated against simulated (median and p90 of |simulated / emulated - 1|). The two sides define
TTFT alike up to the decode side: the client sees its first token after the KV hand-off and the decode
admission, which the simulator counts in TPOT (its first token is the end of prefill); the latency to the last
token is the same quantity on both. Prints a table and writes `--json`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table
from shedding_runtime import (  # benchmarks/shedding_runtime.py
    Request,
    replay,
    replay_options,
    request_sets,
    requests_of,
    serving,
)

from coral.allocation.allocator import allocate
from coral.catalog.loader import load_scenario
from coral.catalog.schema import Scenario
from coral.simulation import simulate
from coral.templates.store import load_library


def compare(sc: Scenario, requests: list[Request], emulated: list[dict[str, Any]],
            sim: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per model and for all: requests, answered (emulated) and finished (simulated), attainment of each SLO
    on each side, and the error of the simulated latency to the last token."""
    names = [m.model for m in sc.models]
    slo = {m.model: (m.prefill_slo_ms / 1e3, m.decode_slo_ms / 1e3) for m in sc.models}
    sim_at = {(names[int(m)], round(float(a), 6)): k for k, (m, a) in enumerate(zip(sim["model"], sim["arrival_s"],
                                                                                    strict=True))}
    out: dict[str, dict[str, Any]] = {}
    for name in [*names, "all"]:
        mine = [(req, rec) for req, rec in zip(requests, emulated, strict=True) if name in (req[1], "all")]
        if not mine:
            continue
        row: dict[str, Any] = {"requests": len(mine)}
        for side in ("emulated", "simulated"):
            ttft_ok = tpot_ok = both = done = 0
            for req, rec in mine:
                if side == "emulated":
                    if rec["outcome"] != "answered":
                        continue
                    ttft, tpot = rec["ttft_s"], rec["tpot_s"]
                else:
                    k = sim_at[(req[1], round(req[0], 6))]
                    ttft, tpot = float(sim["ttft_s"][k]), float(sim["tpot_s"][k])
                    if not np.isfinite(ttft) or not np.isfinite(tpot):
                        continue
                done += 1
                a, b = ttft <= slo[req[1]][0], tpot <= slo[req[1]][1]
                ttft_ok, tpot_ok, both = ttft_ok + a, tpot_ok + b, both + (a and b)
            n = len(mine)
            row[side] = {"done": done, "ttft": ttft_ok / n, "tpot": tpot_ok / n, "both": both / n}
        errors = []
        for req, rec in mine:
            k = sim_at[(req[1], round(req[0], 6))]
            sim_latency = float(sim["done_s"][k] - sim["arrival_s"][k])
            if rec["outcome"] == "answered" and np.isfinite(sim_latency) and rec["latency_s"] > 0:
                errors.append(abs(sim_latency / rec["latency_s"] - 1))
        row["latency_error_p50"] = float(np.median(errors)) if errors else float("nan")
        row["latency_error_p90"] = float(np.quantile(errors, 0.9)) if errors else float("nan")
        out[name] = row
    return out


def main() -> None:
    ap = replay_options(__doc__, "out/benchmarks/emulated_fidelity.json")
    ap.add_argument("--duration", type=float, default=30.0, help="scenario seconds of requests")
    args = ap.parse_args()

    started = time.perf_counter()
    sc = load_scenario(args.scenario)
    plan = allocate(load_library(args.scenario, Path("out")), sc)
    requests = requests_of(sc, args.duration, args.seed, args.max_output)
    k = args.time_scale
    with tempfile.TemporaryDirectory() as tmp, serving(sc, plan, "off", k, Path(tmp)) as srv:
        emulated = asyncio.run(replay(srv, requests, k))
    sim = simulate(plan, sc, request_sets(requests), duration_s=args.duration, startup_delay_s=0.0, shed="off")
    rows = compare(sc, requests, emulated, sim.per_request())

    console = table_console()
    table = Table(title=f"{sc.name}: the allocator's plan (${plan.cost_per_hour:,.2f}/h) on coral serve --backend "
                        f"emulated (time x{k:g}) and in the simulator, the same {len(requests):,} held-out requests "
                        f"({args.duration:g} s, seed {args.seed}, outputs <= {args.max_output})")
    for col in ("model", "requests", "emulated: TTFT / TPOT / both", "simulated: TTFT / TPOT / both",
                "latency to last token, |sim/emu - 1| p50 / p90"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, row in rows.items():
        cells = [f"{row[s]['ttft']:.1%} / {row[s]['tpot']:.1%} / {row[s]['both']:.1%}" for s in ("emulated",
                                                                                               "simulated")]
        table.add_row(name, f"{row['requests']:,}", *cells,
                      f"{row['latency_error_p50']:.1%} / {row['latency_error_p90']:.1%}")
    console.print(table)
    wall = time.perf_counter() - started
    console.print(f"wall time {wall:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_json({"scenario": sc.name, "duration_s": args.duration, "time_scale": k,
                                     "seed": args.seed, "max_output": args.max_output,
                                     "plan_cost_per_hour": plan.cost_per_hour, "models": rows, "wall_s": wall},
                                    indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
