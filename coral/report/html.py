"""Render the view model into one self-contained HTML page (inline CSS, JS and data; no network)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any

from pydantic import BaseModel

from coral.allocation.plan import Plan
from coral.catalog.loader import Catalog
from coral.catalog.schema import Scenario
from coral.report.inputs import EpochPoint, ReportInputs
from coral.report.view import view_model
from coral.simulation.metrics import SimResult

_SLOT = re.compile(r"\{\{(TITLE|CSS|JS|DATA|CONFIG)\}\}")


@cache
def asset(name: str) -> str:
    """Text of a file under coral/report/assets/."""
    return resources.files("coral.report").joinpath("assets", name).read_text()


def script_json(data: Any) -> str:
    """JSON safe to place inside <script type="application/json"> (no '</script>', no HTML comments)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(vm: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str:
    """The page for view model `vm`; `config` = {"poll_url": ..., "interval_ms": ...} makes it live."""
    slots = {
        "TITLE": html.escape(str(vm.get("title", "Coral report"))),
        "CSS": asset("report.css"),
        "JS": asset("report.js"),
        "DATA": script_json(vm),
        "CONFIG": script_json(dict(config or {})),
    }
    # one pass, so substituted text is never scanned for slots again
    return _SLOT.sub(lambda m: slots[m.group(1)], asset("report.html"))


def build_report(
    plan: Plan,
    *,
    baselines: Sequence[Plan] = (),
    sim: SimResult | ReportInputs | BaseModel | Mapping[str, Any] | None = None,
    epochs: Sequence[EpochPoint | Mapping[str, Any]] | None = None,
    catalog: Catalog | None = None,
    scenario: Scenario | None = None,
) -> str:
    """Self-contained HTML report of `plan`, its baselines, and optional simulation / per-epoch results
    (`sim`: a SimResult, ReportInputs or their JSON dicts; `catalog` and `scenario`: the market and demand it was
    planned for, by default its built-in scenario's; see `view_model`)."""
    return render_page(view_model(plan, baselines=baselines, sim=sim, epochs=epochs, catalog=catalog,
                                  scenario=scenario))
