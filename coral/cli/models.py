"""`coral models list|add`: the model catalogue, extended from Hugging Face config.json files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
import yaml

from coral.catalog.loader import CoralInputError, builtin_catalog, model_from_hf_config, user_models_dir
from coral.cli.common import console, friendly_errors

models_app = typer.Typer(help="Model catalogue.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


@models_app.command("list")
@friendly_errors
def list_cmd() -> None:
    """Known models with their size and architecture."""
    from coral.perf import RooflineModel
    from coral.report.terminal import FoldingTable

    pm = RooflineModel()
    t = FoldingTable(title="Models")
    for col in ("name", "layers", "weights GB", "active B params", "MoE", "hybrid attn", "Hugging Face id"):
        t.add_column(col, no_wrap=col == "name", optional=col in ("MoE", "hybrid attn"))
    for m in builtin_catalog().models.values():
        sh = pm.shape(m)
        t.add_row(m.name, str(m.num_hidden_layers), f"{sh.model_bytes / 1e9:.1f}",
                  f"{sh.active_params * m.num_hidden_layers / 1e9:.1f}",
                  f"{m.num_experts}/{m.num_experts_per_tok}" if m.is_moe else "-",
                  "yes" if m.hybrid_attention else "-", m.hf_id)
    console.print(t)


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def cached_hf_config(hf_id: str) -> Path:
    """config.json of `hf_id` ('ORG/NAME') from the local Hugging Face cache (newest snapshot); no download."""
    if hf_id.count("/") != 1 or not all(hf_id.split("/")):
        raise CoralInputError(f"--hf-id: must look like ORG/NAME (e.g. Qwen/Qwen2.5-7B-Instruct), not {hf_id!r}")
    snapshots = hf_cache_dir() / f"models--{hf_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    if not found:
        raise CoralInputError(
            f"--hf-id {hf_id}: no config.json in the local Hugging Face cache ({snapshots}); Coral does not "
            "download. Fetch it where there is network (`huggingface-cli download "
            f"{hf_id} config.json`) or pass the file: coral models add NAME path/to/config.json"
        )
    return found[-1]


@models_app.command("add")
@friendly_errors
def add_cmd(
    name: str = typer.Argument(..., help="name to use in scenarios"),
    hf_config: Path | None = typer.Argument(None, help="the model's Hugging Face config.json (or use --hf-id)"),
    hf_id: str | None = typer.Option(
        None, "--hf-id", help="ORG/NAME: read config.json from the local Hugging Face cache (no download)"
    ),
    expert_weight_bits: float = typer.Option(16.0, help="bits per expert weight (4.25 for MXFP4)"),
) -> None:
    """Add a model from its config.json; it is then usable in any scenario. User models are kept as YAML files
    in $CORAL_HOME/models (default ~/.coral/models); delete a file there to remove the model."""
    if (hf_config is None) == (hf_id is None):
        raise CoralInputError("give either a config.json path or --hf-id ORG/NAME (not both)")
    path_in = hf_config if hf_config is not None else cached_hf_config(str(hf_id))
    try:
        cfg = json.loads(path_in.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CoralInputError(f"{path_in}: cannot read config.json ({exc})") from exc
    if name in builtin_catalog().models:
        raise CoralInputError(f"model {name!r} exists already")
    extra = {"hf_id": hf_id} if hf_id else {}
    arch = model_from_hf_config(name, cfg, expert_weight_bits=expert_weight_bits, source=str(path_in), **extra)
    folder = user_models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(arch.model_dump(mode="json"), sort_keys=False))
    builtin_catalog.cache_clear()
    console.print(f"added {name}: {arch.num_hidden_layers} layers -> [bold]{path}[/]")
