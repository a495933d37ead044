"""Request sets of the SLO search: what the tuning and the held-out sets of each scenario hold, per model.

Tuning sets (`SearchSettings.tune_seeds`, and the burst rule's seed) read only the first half of each trace's
time span, held-out sets (`SearchSettings.held_out_seeds`) only the second half (`coral.workload.traces`,
`TracePart`), so no held-out request is one the planner tuned on. Per (model, part) the table gives the seeds,
the requests simulated over all of the part's seeds and the minutes simulated, the part of the trace read (in
trace minutes) and its recorded requests, the distinct recorded requests the sets use, and how many recorded
requests the model's tuning and held-out sets share (0). Beside them, the burst factors of the percentile rule
(`coral.allocation.demand.model_burst`), computed on the tuning part.

    .venv/bin/python benchmarks/request_sets.py [--scenario core --scenario extended] [--duration SECONDS]

Writes out/benchmarks/request_sets.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.demand import model_burst, run_length_s
from coral.catalog.loader import load_scenario
from coral.planning.slo_search import SearchSettings
from coral.workload.traces import TRACE_SPLIT, request_sets


def scenario_rows(name: str, duration: float | None) -> tuple[float, list[dict[str, Any]]]:
    sc = load_scenario(name)
    settings = SearchSettings()
    seconds = duration or run_length_s(sc)
    rows = request_sets(sc, seconds, settings.tune_seeds, settings.held_out_seeds)
    burst = {sm.model: model_burst(sc, sm) for sm in sc.models}
    for row in rows:
        row["scenario"] = name
        if row["part"] == "tune":
            prefill, decode = burst[str(row["model"])]
            row["burst_prefill"], row["burst_decode"] = round(prefill, 2), round(decode, 2)
    return seconds, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", action="append", default=None, help="scenario (repeatable; default core, extended)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per set (default: the run length)")
    ap.add_argument("--out", type=Path, default=Path("out"))
    args = ap.parse_args()
    console = table_console(pipe_width=180)
    report: dict[str, Any] = {"split": TRACE_SPLIT, "scenarios": {}}
    for name in args.scenario or ["core", "extended"]:
        seconds, rows = scenario_rows(name, args.duration)
        report["scenarios"][name] = {"duration_s": seconds, "rows": rows}
        table = Table(title=f"{name}: request sets of {seconds / 60:g} simulated minutes each; tuning sets read the "
                            f"first {TRACE_SPLIT:.0%} of each trace's span, held-out sets the rest")
        cols = ["model", "trace", "part", "seeds", "requests", "sim min", "trace min (from-to)", "trace requests",
                "distinct used", "shared", "burst p / d (tune)"]
        for col in cols:
            table.add_column(col, justify="left" if col in ("model", "trace", "part") else "right")
        for r in rows:
            window = ("-" if r["trace_minutes"] is None
                      else f"{r['trace_minutes']:.1f} ({r['trace_from_min']:.1f}-{r['trace_to_min']:.1f})")
            burst = f"{r['burst_prefill']:.2f} / {r['burst_decode']:.2f}" if "burst_prefill" in r else ""
            table.add_row(str(r["model"]), str(r["trace"]), str(r["part"]), ",".join(map(str, r["seeds"])),
                          f"{r['requests']:,}", f"{r['minutes']:g}", window,
                          "-" if r["trace_requests"] is None else f"{r['trace_requests']:,}",
                          "-" if r["distinct_used"] is None else f"{r['distinct_used']:,}",
                          "-" if r["shared"] is None else str(r["shared"]), burst)
        console.print(table)
    path = args.out / "benchmarks" / "request_sets.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stamped_json(report, indent=2) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
