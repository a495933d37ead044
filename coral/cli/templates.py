"""`coral templates build|show`: the offline stage."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from coral.catalog.loader import CoralInputError, builtin_catalog, load_scenario, scenario_and_market
from coral.catalog.suggest import did_you_mean
from coral.cli.common import (
    DEFAULT_OUT,
    OFFERINGS_HELP,
    check_out_folder,
    console,
    err_console,
    friendly_errors,
    library_path,
)

templates_app = typer.Typer(help="Offline stage: the Serving Template Library.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(templates_app, name="templates")


@templates_app.command("build")
@friendly_errors
def build_cmd(
    scenario: str = typer.Argument("core", help="built-in scenario name or scenario YAML"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder"),
    workers: int = typer.Option(os.cpu_count() or 1, help="local worker processes"),
    ray: bool = typer.Option(False, "--ray", help="distribute on a Ray cluster (RAY_ADDRESS or a local one)"),
    vllm_compatible: bool = typer.Option(False, help="keep only templates stock vLLM can launch"),
    perf_params: Path | None = typer.Option(None, help="calibrated perf-model parameters (YAML)"),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
) -> None:
    """Enumerate node combinations and solve each one's optimal placement."""
    from coral.perf.roofline import PerfParams, RooflineModel
    from coral.report.terminal import FoldingTable, progress
    from coral.templates.build import build_library

    check_out_folder(out)
    t0 = time.perf_counter()
    sc, cat = scenario_and_market(scenario, offerings)
    perf = RooflineModel(PerfParams.load(perf_params) if perf_params else None)
    stage_filter = None
    if vllm_compatible:
        from coral.deploy.vllm import vllm_compatible_filter

        stage_filter = vllm_compatible_filter
    with progress(console=err_console, transient=True) as bar:
        task = bar.add_task(f"placement jobs of {sc.name}", total=None)
        lib = build_library(sc, cat, perf=perf, workers=workers, use_ray=ray, stage_filter=stage_filter,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    path = lib.save(library_path(scenario, out))
    stats = json.loads(lib.meta["stats"])
    table = FoldingTable(title=f"Serving Template Library: {sc.name}")
    for col in ("model/phase", "candidates", "feasible", "kept", "non-dominated"):
        table.add_column(col, justify="right" if col != "model/phase" else "left", no_wrap=col == "model/phase")
    for key, st in stats.items():
        m, p = key.split("/")
        table.add_row(key, f"{st['candidates']:,}", f"{st['feasible']:,}", f"{st['kept']:,}",
                      f"{len(lib.select(m, p, include_dominated=False)):,}")
    console.print(table)
    console.print(f"{len(lib):,} templates; time: {time.perf_counter() - t0:.1f} s end to end (enumeration and "
                  f"placement {float(lib.meta['build_seconds']):.1f} s) -> [bold]{path}[/]")


@templates_app.command("show")
@friendly_errors
def show_cmd(
    model: str = typer.Argument(..., help="model name, e.g. qwen3-32b"),
    scenario: str = typer.Option("core", help="scenario whose library to read (built if missing)"),
    phase: str = typer.Option("prefill", help="prefill or decode"),
    region: str | None = typer.Option(None, help="price region (default: scenario's first)"),
    top: int = typer.Option(10, min=1, help="rows to show"),
    out: Path = typer.Option(DEFAULT_OUT, help="folder holding libraries"),
) -> None:
    """Best templates of a model by tokens/s per $ in a region."""
    if phase not in ("prefill", "decode"):
        raise CoralInputError(f"--phase: must be prefill or decode, not {phase!r}")
    import numpy as np

    from coral.report.terminal import FoldingTable
    from coral.templates.store import load_library

    sc = load_scenario(scenario)
    region = region or sc.regions[0]
    if region not in sc.regions:
        raise CoralInputError(f"--region: {region!r} is not in scenario {sc.name}{did_you_mean(region, sc.regions)}; "
                              f"its regions: {', '.join(sc.regions)}")
    lib = load_library(scenario, out)
    rows = lib.select(model, phase)
    if not len(rows):
        known = sorted({m for m, _ in lib.keys()})
        raise CoralInputError(f"model {model!r} has no templates in {sc.name}{did_you_mean(model, known)}; "
                              f"models: {', '.join(known)}")
    cost = lib.costs(builtin_catalog().prices(region))[rows]
    with np.errstate(divide="ignore"):
        eff = np.where(np.isfinite(cost), lib.throughput[rows] / cost, 0.0)
    order = rows[np.argsort(-eff, kind="stable")][:top]
    table = FoldingTable(title=f"{model} {phase} in {region}: best tokens/s per $")
    for col in ("id", "nodes", "stages (layers: nodes)", "tokens/s", "$/h", "tokens/s/$"):
        table.add_column(col)
    for i in order:
        t = lib.template(int(i))
        c = t.cost(builtin_catalog().prices(region))
        nodes = " + ".join(f"{n}×{cfg}" for cfg, n in t.counts.items())
        stages = " | ".join(f"{s.layers}L: " + ",".join(f"{s.nodes.count(c)}×{c}" for c in dict.fromkeys(s.nodes))
                            for s in t.stages)
        table.add_row(str(t.id), nodes, stages, f"{t.throughput:,.0f}", f"{c:.2f}", f"{t.throughput / c:,.0f}")
    console.print(table)
