"""`coral models list|add`: the model catalogue, extended from Hugging Face config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import typer
import yaml
from rich.table import Table

from coral.catalog.loader import CoralInputError, builtin_catalog, model_from_hf_config, user_models_dir
from coral.cli.common import console, friendly_errors
from coral.perf import RooflineModel

models_app = typer.Typer(help="Model catalogue.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


@models_app.command("list")
@friendly_errors
def list_cmd() -> None:
    """Known models with their size and architecture."""
    pm = RooflineModel()
    t = Table(title="Models")
    for col in ("name", "layers", "weights GB", "active B params", "MoE", "hybrid attn", "Hugging Face id"):
        t.add_column(col)
    for m in builtin_catalog().models.values():
        sh = pm.shape(m)
        t.add_row(m.name, str(m.num_hidden_layers), f"{sh.model_bytes / 1e9:.1f}",
                  f"{sh.active_params * m.num_hidden_layers / 1e9:.1f}",
                  f"{m.num_experts}/{m.num_experts_per_tok}" if m.is_moe else "-",
                  "yes" if m.hybrid_attention else "-", m.hf_id)
    console.print(t)


@models_app.command("add")
@friendly_errors
def add_cmd(
    name: str = typer.Argument(..., help="name to use in scenarios"),
    hf_config: Path = typer.Argument(..., help="the model's Hugging Face config.json"),
    expert_weight_bits: float = typer.Option(16.0, help="bits per expert weight (4.25 for MXFP4)"),
) -> None:
    """Add a model from its config.json; it is then usable in any scenario."""
    try:
        cfg = json.loads(hf_config.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CoralInputError(f"{hf_config}: cannot read config.json ({exc})") from exc
    if name in builtin_catalog().models:
        raise CoralInputError(f"model {name!r} exists already")
    arch = model_from_hf_config(name, cfg, expert_weight_bits=expert_weight_bits, source=str(hf_config))
    folder = user_models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(arch.model_dump(mode="json"), sort_keys=False))
    builtin_catalog.cache_clear()
    console.print(f"added {name}: {arch.num_hidden_layers} layers -> [bold]{path}[/]")
