"""Load catalogs and scenarios from package data or user files, with errors that name the field."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from coral.catalog.schema import (
    GpuCatalog,
    GpuSpec,
    ModelArch,
    ModelCatalog,
    NodeOffering,
    OfferingCatalog,
    Scenario,
    parse_config_name,
)

T = TypeVar("T", bound=BaseModel)


class CoralInputError(ValueError):
    """Bad user input: the message names the file, the field and the reason."""


def _read_structured(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise CoralInputError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise CoralInputError(f"{path}: malformed {path.suffix.lstrip('.') or 'yaml'}: {exc}") from exc
    except RecursionError:
        raise CoralInputError(f"{path}: nested too deeply") from None


def format_validation_error(source: str, exc: ValidationError) -> str:
    lines = [f"{source}: invalid input"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        shown = f" (got {got!r:.80})" if isinstance(got, int | float | str) else ""
        lines.append(f"  {where}: {err['msg']}{shown}")
    return "\n".join(lines)


def validate(schema: type[T], data: Any, source: str) -> T:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise CoralInputError(format_validation_error(source, exc)) from exc


def load_file(schema: type[T], path: str | Path) -> T:
    path = Path(path)
    return validate(schema, _read_structured(path), str(path))


def data_path(*parts: str) -> Path:
    return Path(str(resources.files("coral").joinpath("data", *parts)))


@dataclass(frozen=True)
class NodeConfig:
    """A node shape: `count` GPUs of one type (e.g. 2xL40S), independent of region."""

    name: str
    gpu: GpuSpec
    count: int
    nic_gbps: float

    @property
    def memory_gb(self) -> float:
        return self.gpu.memory_gb * self.count

    @property
    def nic_bytes_s(self) -> float:
        """Network bandwidth in bytes/s (what KV hand-offs are charged at)."""
        return self.nic_gbps * 1e9 / 8


@dataclass(frozen=True)
class Catalog:
    """GPU types, rentable offerings and model architectures."""

    gpus: dict[str, GpuSpec]
    offerings: tuple[NodeOffering, ...]
    models: dict[str, ModelArch]

    def gpu(self, name: str) -> GpuSpec:
        try:
            return self.gpus[name]
        except KeyError:
            raise CoralInputError(f"unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}") from None

    def model(self, name: str) -> ModelArch:
        try:
            return self.models[name]
        except KeyError:
            raise CoralInputError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}") from None

    def node_config(self, name: str) -> NodeConfig:
        try:
            gpu_name, count = parse_config_name(name)
        except ValueError as exc:
            raise CoralInputError(str(exc)) from None
        gpu = self.gpu(gpu_name)
        nics = [o.nic_gbps for o in self.offerings if o.config == name]
        return NodeConfig(name=name, gpu=gpu, count=count, nic_gbps=min(nics) if nics else 25.0)

    def prices(self, region: str) -> dict[str, float]:
        """Cheapest on-demand $/node-hour per config offered in `region`."""
        out: dict[str, float] = {}
        for o in self.offerings:
            if o.region == region:
                out[o.config] = min(out.get(o.config, o.price_per_hour), o.price_per_hour)
        return out

    def regions(self) -> list[str]:
        return sorted({o.region for o in self.offerings})

    def with_models(self, extra: list[ModelArch]) -> Catalog:
        models = dict(self.models)
        models.update({m.name: m for m in extra})
        return Catalog(gpus=self.gpus, offerings=self.offerings, models=models)

    def with_offerings(self, offerings: list[NodeOffering]) -> Catalog:
        return Catalog(gpus=self.gpus, offerings=tuple(offerings), models=self.models)

    def with_prices(self, prices: Mapping[str, Mapping[str, float]]) -> Catalog:
        """This catalog with the $/node-hour of the offerings of {region: {config: price}} replaced; a pair
        that no offering sells is an error."""
        sold = {(o.region, o.config) for o in self.offerings}
        for region, cfgs in prices.items():
            for cfg in cfgs:
                if (region, cfg) not in sold:
                    raise CoralInputError(f"prices.{region}.{cfg}: no offering sells {cfg} in {region}")
        return self.with_offerings([o.model_copy(update={"price_per_hour": float(prices[o.region][o.config])})
                                    if o.config in prices.get(o.region, {}) else o for o in self.offerings])


def user_models_dir() -> Path:
    """Where `coral models add` keeps user models: $CORAL_HOME/models (default ~/.coral/models)."""
    return Path(os.environ.get("CORAL_HOME", Path.home() / ".coral")) / "models"


def user_models() -> list[ModelArch]:
    folder = user_models_dir()
    if not folder.is_dir():
        return []
    return [load_file(ModelArch, p) for p in sorted(folder.glob("*.yaml"))]


@cache
def builtin_catalog() -> Catalog:
    """Packaged GPUs, offerings and models, plus the user's models from `user_models_dir()`."""
    gpus = load_file(GpuCatalog, data_path("gpus.yaml"))
    offers = load_file(OfferingCatalog, data_path("offerings.yaml"))
    models = load_file(ModelCatalog, data_path("models.yaml"))
    cat = Catalog(
        gpus={g.name: g for g in gpus.gpus},
        offerings=tuple(offers.offerings),
        models={m.name: m for m in [*models.models, *user_models()]},
    )
    for o in cat.offerings:
        cat.gpu(o.gpu)
    return cat


def builtin_scenarios() -> list[str]:
    return sorted(p.stem for p in data_path("scenarios").iterdir() if p.suffix == ".yaml")


def load_scenario(name_or_path: str | Path, catalog: Catalog | None = None) -> Scenario:
    """Load a built-in scenario by name or a scenario file, and check it against the catalog."""
    path = Path(name_or_path)
    if not path.exists() and str(name_or_path) in builtin_scenarios():
        path = data_path("scenarios", f"{name_or_path}.yaml")
    elif not path.exists():
        raise CoralInputError(
            f"scenario {name_or_path!r}: no such file and not a built-in one ({', '.join(builtin_scenarios())})"
        )
    scenario = load_file(Scenario, path)
    if scenario.offerings is not None:  # resolved against the scenario's folder, so later readers find it
        scenario = scenario.model_copy(update={"offerings": str((path.parent / scenario.offerings).resolve())})
    check_scenario(scenario, catalog or market_catalog(scenario), str(path))
    return scenario


def scenario_and_market(scenario: str | Path, offerings: str | Path | None = None) -> tuple[Scenario, Catalog]:
    """The scenario, checked against the market it plans in (`offerings` when given, which then becomes the
    scenario's `offerings` file, so that its later readers plan in it too), and that market."""
    if offerings is None:
        sc = load_scenario(scenario)
        return sc, market_catalog(sc)
    market = load_offerings(offerings)
    return load_scenario(scenario, market).model_copy(update={"offerings": str(Path(offerings).resolve())}), market


def load_offerings(path: str | Path, base: Catalog | None = None) -> Catalog:
    """`base` (default: the built-in catalog) with its offerings replaced by those of the file at `path`,
    validated like every input file (schema, and every offering's GPU known)."""
    return offerings_catalog(load_file(OfferingCatalog, path).offerings, str(path), base)


def offerings_catalog(offerings: list[NodeOffering], source: str, base: Catalog | None = None) -> Catalog:
    """`base` (default: the built-in catalog) with its offerings replaced by `offerings` (read from `source`),
    every offering's GPU known."""
    base = base or builtin_catalog()
    for i, o in enumerate(offerings):
        if o.gpu not in base.gpus:
            raise CoralInputError(f"{source}: offerings.{i}.gpu: unknown GPU {o.gpu!r}; known: {', '.join(sorted(base.gpus))}")
    return base.with_offerings(list(offerings))


def check_region_table(table: Mapping[str, Mapping[str, Any]], scenario: Scenario, where: str) -> None:
    """Every region and config of a {region: {config: value}} table (at `where` of an input) in the scenario."""
    for region, cfgs in table.items():
        if region not in scenario.regions:
            raise CoralInputError(f"{where}: region {region!r} is not in the scenario")
        for cfg in cfgs:
            if cfg not in scenario.configs:
                raise CoralInputError(f"{where}.{region}: config {cfg!r} not in scenario")


def market_catalog(scenario: Scenario, offerings: str | Path | None = None) -> Catalog:
    """The catalog a scenario plans with: the built-in one with the offerings of `offerings` (e.g.
    `--offerings FILE`), else of the scenario's `offerings` file, else the shipped offerings."""
    path = offerings if offerings is not None else scenario.offerings
    return builtin_catalog() if path is None else load_offerings(path)


def check_scenario(scenario: Scenario, catalog: Catalog, source: str) -> None:
    for i, m in enumerate(scenario.models):
        if m.model not in catalog.models:
            raise CoralInputError(f"{source}: models.{i}.model: unknown model {m.model!r}")
    for c in scenario.configs:
        gpu, _ = parse_config_name(c)
        if gpu not in catalog.gpus:
            raise CoralInputError(f"{source}: configs: unknown GPU {gpu!r} in {c!r}")
    for r in scenario.regions:
        if not catalog.prices(r):
            raise CoralInputError(f"{source}: regions: no offerings known for region {r!r}")


def model_from_hf_config(name: str, config: dict[str, Any], **overrides: Any) -> ModelArch:
    """Build a ModelArch from the fields of a Hugging Face ``config.json``."""
    cfg = dict(config.get("text_config", config))
    fields = {
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "num_attention_heads": cfg.get("num_attention_heads"),
        "num_key_value_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
        "head_dim": cfg.get("head_dim"),
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg.get("vocab_size"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "num_experts": cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 0)) or 0,
        "moe_intermediate_size": cfg.get("moe_intermediate_size")
        or (cfg.get("intermediate_size") if cfg.get("num_local_experts") else None),
        "sliding_window": cfg.get("sliding_window") if cfg.get("layer_types") else None,
        "layer_types": cfg.get("layer_types"),
        "dtype": "float16" if cfg.get("torch_dtype") == "float16" else "bfloat16",
        "hf_id": cfg.get("_name_or_path", ""),
        "model_type": cfg.get("model_type", ""),
    }
    fields.update(overrides)
    return validate(ModelArch, {"name": name, **fields}, f"config.json of {name}")
