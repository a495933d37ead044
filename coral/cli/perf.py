"""`coral perf table|calibrate`: inspect and calibrate the performance model."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import yaml

from coral import vllm_cpu
from coral.catalog.loader import CoralInputError, builtin_catalog, data_path
from coral.catalog.schema import parse_config_name
from coral.cli.common import check_out_file, check_out_folder, console, friendly_errors

if TYPE_CHECKING:
    from coral.perf import Phase

perf_app = typer.Typer(help="Performance model: throughput tables and calibration.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(perf_app, name="perf")


def _phase(value: str) -> Phase:
    from coral.perf import Phase

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
    from coral.perf import RooflineModel, Workload
    from coral.perf.measured import MeasuredModel
    from coral.report.terminal import FoldingTable

    cat = builtin_catalog()
    arch, node = cat.model(model), cat.node_config(config)
    pm = MeasuredModel.from_folder(profiles) if profiles else RooflineModel()
    w = Workload(input_tokens, output_tokens)
    thr, batch = pm.throughput_table(arch, _phase(phase), node, slo_ms / 1e3, stages, w)
    t = FoldingTable(title=f"{model} {phase} on {config}: budget {slo_ms / stages:.1f} ms/stage, fits "
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
    profiles: Path | None = typer.Argument(None, help="profile folder (Helix layout, e.g. a100/prompt_bs2time.csv); "
                                           "default: the shipped Helix LLaMA-2 70B sample"),
    model: str | None = typer.Option(None, help="model the profiles were measured on (default: profile.yaml)"),
    folder_map: list[str] = typer.Option([], "--map", help="folder=config, e.g. a100=1xA100-40G"),
    input_tokens: float | None = typer.Option(None, min=1, help="mean prompt tokens of the profiled workload "
                                              "(default: profile.yaml, else 1024)"),
    output_tokens: float | None = typer.Option(None, min=1, help="mean output tokens (default: profile.yaml, else 128)"),
    params_file: Path | None = typer.Option(None, "--params", help="parameters to start from (default: shipped)"),
    out: Path = typer.Option(Path("out/perf_params.yaml"), help="where to write the calibrated parameters"),
    warn_median: float = typer.Option(0.10, min=0, help="warn when a config/phase's median |error| exceeds this"),
    warn_worst: float = typer.Option(0.25, min=0, help="warn when a config/phase's worst |error| exceeds this"),
) -> None:
    """Fit per-GPU efficiency factors to measured per-layer profiles and write a parameter file."""
    from coral.perf import PerfParams, RooflineModel, Workload
    from coral.perf.measured import EFFICIENCY_BOUNDS, ProfileSet, calibrate, error_summary, relative_errors
    from coral.report.terminal import FoldingTable

    check_out_file(out)
    folder = profiles or data_path("profiles", "helix-llama2-70b")
    mapping = {}
    for item in folder_map:
        name, sep, config = item.partition("=")
        if not sep or not name or not config:
            raise CoralInputError(f"--map: expected folder=config, not {item!r}")
        mapping[name] = config
    cat = builtin_catalog()
    pset = ProfileSet.read(folder, mapping, cat)
    man = pset.manifest
    model_name = model or man.model
    if model_name is None:
        raise CoralInputError("--model: required (the profile folder has no profile.yaml naming the model)")
    w = Workload(input_tokens or man.input_tokens or 1024, output_tokens or man.output_tokens or 128)
    arch = cat.model(model_name)
    start = RooflineModel(PerfParams.load(params_file))
    with console.status(f"fitting {len(pset.profiles)} profiles"):
        params, fits = calibrate(start, arch, pset, w, f"coral perf calibrate on {folder.name} ({model_name}, "
                                 f"workload {w.input_tokens:g}/{w.output_tokens:g} tokens)", cat)
    before = relative_errors(start, arch, pset, w, cat)
    after = relative_errors(RooflineModel(params), arch, pset, w, cat)
    t = FoldingTable(title=f"per-layer |predicted/measured - 1| on {folder.name}")
    for col in ("config", "phase", "points", "median before", "worst before", "median after", "worst after"):
        t.add_column(col, justify="right")
    warnings = []
    for key, err in after.items():
        (med0, worst0), (med1, worst1) = error_summary(before[key]), error_summary(err)
        t.add_row(key[0], str(key[1]), str(len(err)), f"{med0:.1%}", f"{worst0:.1%}", f"{med1:.1%}", f"{worst1:.1%}")
        if med1 > warn_median or worst1 > warn_worst:
            warnings.append(f"{key[0]} {key[1]} fits poorly: median {med1:.1%}, worst {worst1:.1%} "
                            f"(warn above {warn_median:.0%} / {warn_worst:.0%})")
    console.print(t)
    for fit in fits:
        values = ", ".join(f"{k.removesuffix('_efficiency')} {getattr(fit.override, k):.3f}" for k in fit.fitted)
        console.print(f"{fit.gpu}: {values}; rms log error {fit.rms_log_error:.3f}")
        lo, hi = EFFICIENCY_BOUNDS
        warnings += [f"{fit.gpu} {k} = {getattr(fit.override, k):.3f} is at its bound [{lo}, {hi}]: the model "
                     "does not explain these measurements with a physical value" for k in fit.at_bounds]
    for msg in warnings:
        console.print(f"[yellow]warning[/]: {msg}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(params.model_dump(mode="json", exclude_none=True), sort_keys=False))
    console.print(f"-> [bold]{out}[/]")


@perf_app.command("profile")
@friendly_errors
def profile_cmd(
    config: str = typer.Option(..., help="node config of this machine, e.g. 2xL40S, or 1xCPU for vLLM on CPU"),
    model: str | None = typer.Option(None, help="catalog model to profile (recorded in profile.yaml); its "
                                     "Hugging Face id, or for tiny-llama a local config, is what vLLM serves"),
    model_id: str | None = typer.Option(None, help="Hugging Face id or local directory vLLM should serve "
                                        "(default: from --model)"),
    out: Path = typer.Option(Path("profiles"), help="profile folder (Helix layout)"),
    layers: tuple[int, int] = typer.Option((2, 4), help="two layer counts to difference"),
    command: str | None = typer.Option(None, help="engine command template with {layers} {port} {model}"),
    vllm_python: str | None = typer.Option(None, help="1xCPU: the Python with vllm-cpu installed (default: "
                                           f"${vllm_cpu.PYTHON_ENV_VAR}, else `python -m coral.vllm_cpu`'s venv)"),
) -> None:
    """Measure per-layer prefill/decode times with vLLM on this machine (writes Helix-layout CSVs)."""
    from coral.perf.profiler import ProfileSpec, profile, subprocess_launcher

    check_out_folder(out)
    try:
        _, gpus = parse_config_name(config)
    except ValueError as exc:
        raise CoralInputError(f"--config: {exc}") from None
    if model_id is None:
        if model is None:
            raise CoralInputError("--model or --model-id: say which model to profile")
        model_id = vllm_cpu.model_source(builtin_catalog().model(model))
    spec = ProfileSpec(model_id, config, gpus, layer_counts=layers)
    given = {"--config": config, "--model": model, "--model-id": None if model else model_id,
             "--layers": f"{layers[0]} {layers[1]}", "--command": command}
    invocation = "coral perf profile " + " ".join(f"{k} {shlex.quote(v) if k != '--layers' else v}"
                                                  for k, v in given.items() if v)
    with console.status(f"profiling {model or model_id} on {config} with {layers[0]} and {layers[1]} layers"):
        rows = profile(spec, subprocess_launcher(spec, command, python=vllm_python), out, model, invocation)
    for phase, pts in rows.items():
        console.print(f"{phase}: " + ", ".join(f"{b} tok: {ms:.3f} ms/layer" for b, ms in pts))
    console.print(f"-> [bold]{out / config}[/]")
