"""What a template library is built from, as one short hash per part (`coral.templates.store` compares them to
decide when a cached library must be rebuilt; `coral.templates.build` records them in the library)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from coral.catalog.loader import Catalog, market_catalog
from coral.catalog.schema import Scenario
from coral.perf.roofline import RooflineModel
from coral.templates.library import LIBRARY_FORMAT


def fingerprint(scenario: Scenario, catalog: Catalog | None = None, perf: RooflineModel | None = None,
                models: Sequence[str] | None = None) -> dict[str, str]:
    """{part: short sha256} of what a library of `scenario` (only `models`, when given) is built from."""
    catalog = catalog or market_catalog(scenario)
    perf = perf or RooflineModel()
    chosen = [sm for sm in scenario.models if not models or sm.model in models]
    parts: dict[str, Any] = {
        "models": [catalog.model(sm.model).model_dump(mode="json") for sm in chosen],
        "slos": [[sm.model, sm.prefill_slo_ms, sm.decode_slo_ms, sm.mean_input_tokens, sm.mean_output_tokens]
                 for sm in chosen],
        "configs": [dataclasses.asdict(catalog.node_config(c)) for c in scenario.configs],
        "perf": perf.params.model_dump(mode="json"),
        "n_max": scenario.n_max,
        "rho": scenario.rho,
        "format": LIBRARY_FORMAT,
    }
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for k, v in parts.items()}
