"""The paper's evaluation setting (relative GPU prices, unlimited availability, target utilisation 1) and the
waterfall of settings from it to ours, one change at a time; all read from `coral/data/paper_setting.yaml`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog, data_path, load_file
from coral.catalog.schema import NodeOffering, Scenario

MARKET_KEYS = {"prices": "paper", "availability": "unlimited"}  # non-scenario overrides and their only value


class WaterfallStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    drop: list[str] = Field(min_length=1, description="paper_overrides keys reverted to ours at this step")


class PaperSetting(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    source: str
    relative_cost_per_gpu: dict[str, float]
    paper_overrides: dict[str, float | str]
    waterfall: list[WaterfallStep]

    @model_validator(mode="after")
    def _check(self) -> PaperSetting:
        for gpu, rel in self.relative_cost_per_gpu.items():
            if rel <= 0:
                raise ValueError(f"relative_cost_per_gpu.{gpu}: must be > 0")
        for key, value in self.paper_overrides.items():
            if key in MARKET_KEYS and value != MARKET_KEYS[key]:
                raise ValueError(f"paper_overrides.{key}: must be {MARKET_KEYS[key]!r}")
        dropped = [k for step in self.waterfall for k in step.drop]
        if sorted(dropped) != sorted(self.paper_overrides):
            raise ValueError("waterfall: the steps must drop every paper_overrides key exactly once")
        return self


@cache
def paper_setting() -> PaperSetting:
    return load_file(PaperSetting, data_path("paper_setting.yaml"))


def paper_catalog(catalog: Catalog, relative: dict[str, float]) -> Catalog:
    """`catalog` with every offering of a GPU in `relative` repriced to gpus × relative cost × the mean L4
    $/GPU-hour of `catalog` (the same in every region); offerings of other GPUs are dropped."""
    l4 = [o.price_per_hour / o.gpus_per_node for o in catalog.offerings if o.gpu == "L4"]
    if not l4:
        raise CoralInputError("paper prices: the catalog has no L4 offering to anchor the relative costs")
    unit = sum(l4) / len(l4)
    offers: list[NodeOffering] = [o.model_copy(update={"price_per_hour": o.gpus_per_node * relative[o.gpu] * unit,
                                                   "price_date": "relative", "source": paper_setting().source})
                                   for o in catalog.offerings if o.gpu in relative]
    return catalog.with_offerings(offers)


@dataclass(frozen=True)
class Setting:
    """A scenario with the market to plan it on; `unlimited` replaces the scenario's availability."""

    name: str
    scenario: Scenario
    catalog: Catalog
    unlimited: bool


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        if not isinstance(data.get(p), dict):
            raise CoralInputError(f"paper_overrides.{dotted}: {p!r} is not a section of the scenario")
        data = data[p]
    if leaf not in data:
        raise CoralInputError(f"paper_overrides.{dotted}: not a field of the scenario")
    data[leaf] = value


def with_overrides(name: str, scenario: Scenario, overrides: dict[str, float | str],
                   catalog: Catalog | None = None) -> Setting:
    """`scenario` with paper overrides applied (dotted scenario fields, plus `prices` and `availability`)."""
    catalog = catalog or builtin_catalog()
    data = scenario.model_dump()
    for key, value in overrides.items():
        if key not in MARKET_KEYS:
            _set(data, key, value)
    market = paper_catalog(catalog, paper_setting().relative_cost_per_gpu) if "prices" in overrides else catalog
    return Setting(name, Scenario.model_validate(data), market, "availability" in overrides)


def waterfall_settings(scenario: Scenario, catalog: Catalog | None = None) -> list[Setting]:
    """Step 0 = the paper's setting; each next step reverts one more override; the last is `scenario` itself."""
    ps = paper_setting()
    left = dict(ps.paper_overrides)
    steps = [with_overrides("paper setting", scenario, left, catalog)]
    for step in ps.waterfall:
        for key in step.drop:
            del left[key]
        steps.append(with_overrides(step.name, scenario, left, catalog))
    return steps
