"""`coral perf table|calibrate`: inspect and calibrate the performance model."""

from __future__ import annotations

import csv
from pathlib import Path

import typer
import yaml
from rich.table import Table

from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.catalog.schema import parse_config_name
from coral.cli.common import console, friendly_errors
from coral.perf import PerfParams, Phase, RooflineModel, Workload
from coral.perf.measured import MeasuredModel, calibrate

perf_app = typer.Typer(help="Performance model: throughput tables and calibration.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(perf_app, name="perf")


def _phase(value: str) -> Phase:
    try:
        return Phase(value)
    except ValueError:
        raise CoralInputError(f"--phase: must be prefill or decode, not {value!r}") from None


@perf_app.command("table")
@friendly_errors
def table_cmd(
    model: str = typer.Argument(..., help="model name"),
    config: str = typer.Argument(..., help="node config, e.g. 2xL40S"),
    phase: str = typer.Option("decode", help="prefill or decode"),
    slo_ms: float = typer.Option(100.0, min=0.001, help="phase SLO in ms"),
    stages: int = typer.Option(1, min=1, help="pipeline stages sharing the SLO"),
    input_tokens: float = typer.Option(1024, min=1),
    output_tokens: float = typer.Option(128, min=1),
    profiles: Path | None = typer.Option(None, help="folder of measured profiles (Helix layout)"),
    every: int = typer.Option(4, min=1, help="print every n-th layer count"),
) -> None:
    """Throughput (tokens/s) and batch of one node holding j layers under a per-stage budget."""
    cat = builtin_catalog()
    arch, node = cat.model(model), cat.node_config(config)
    pm = MeasuredModel.from_folder(profiles) if profiles else RooflineModel()
    w = Workload(input_tokens, output_tokens)
    thr, batch = pm.throughput_table(arch, _phase(phase), node, slo_ms / 1e3, stages, w)
    t = Table(title=f"{model} {phase} on {config}: budget {slo_ms / stages:.1f} ms/stage, fits "
              f"{pm.max_layers(arch, node, w)} layers")
    for col in ("layers", "tokens/s", "batch"):
        t.add_column(col, justify="right")
    for j in range(1, arch.num_hidden_layers + 1):
        if j % every == 0 or j == arch.num_hidden_layers:
            t.add_row(str(j), f"{thr[j]:,.0f}", f"{batch[j]:,.0f}")
    console.print(t)


@perf_app.command("calibrate")
@friendly_errors
def calibrate_cmd(
    points: Path = typer.Argument(..., help="CSV with header layers,batch,ms (measured step times)"),
    model: str = typer.Option(..., help="model the points were measured on"),
    config: str = typer.Option(..., help="node config the points were measured on"),
    phase: str = typer.Option("decode", help="prefill or decode"),
    input_tokens: float = typer.Option(1024, min=1),
    output_tokens: float = typer.Option(128, min=1),
    out: Path = typer.Option(Path("out/perf_params.yaml"), help="where to write the calibrated parameters"),
) -> None:
    """Fit the GPU's efficiency factors to measured step times and write a parameter file."""
    try:
        with points.open() as f:
            rows = [(int(r["layers"]), float(r["batch"]), float(r["ms"]) / 1e3) for r in csv.DictReader(f)]
    except (OSError, KeyError, ValueError) as exc:
        raise CoralInputError(f"{points}: expected CSV columns layers,batch,ms ({exc})") from exc
    cat = builtin_catalog()
    node = cat.node_config(config)
    params, err = calibrate(RooflineModel(PerfParams.load()), cat.model(model), _phase(phase), node, rows,
                            Workload(input_tokens, output_tokens))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    o = params.gpu_overrides[node.gpu.name]
    console.print(f"{node.gpu.name}: compute {o.compute_efficiency:.2f}, memory {o.memory_efficiency:.2f}, "
                  f"overhead {o.step_overhead_ms:.1f} ms; rms relative error {err:.1%} -> [bold]{out}[/]")


@perf_app.command("profile")
@friendly_errors
def profile_cmd(
    model_id: str = typer.Option(..., help="Hugging Face model id vLLM should serve"),
    config: str = typer.Option(..., help="node config of this machine, e.g. 2xL40S"),
    out: Path = typer.Option(Path("profiles"), help="profile folder (Helix layout)"),
    layers: tuple[int, int] = typer.Option((2, 4), help="two layer counts to difference"),
    command: str | None = typer.Option(None, help="engine command template with {layers} {port} {model}"),
) -> None:
    """Measure per-layer prefill/decode times with vLLM on this GPU machine (writes Helix-layout CSVs)."""
    from coral.perf.profiler import ProfileSpec, profile, subprocess_launcher

    _, gpus = parse_config_name(config)
    spec = ProfileSpec(model_id, config, gpus, layer_counts=layers)
    with console.status(f"profiling {model_id} on {config} with {layers[0]} and {layers[1]} layers"):
        rows = profile(spec, subprocess_launcher(spec, command), out)
    for phase, pts in rows.items():
        console.print(f"{phase}: " + ", ".join(f"{b} tok: {ms:.3f} ms/layer" for b, ms in pts))
    console.print(f"-> [bold]{out / config}[/]")
