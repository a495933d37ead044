"""Built libraries cached per scenario (`<out>/<scenario>.templates.sqlite`) and what each was built from.

A library records a *fingerprint* of its inputs, one hash per part: the model architectures, the SLOs and mean
request shapes it was rated at, the node configs (GPU specs and network bandwidth), the perf model's parameters,
`n_max`, `rho` and the library format. `load_library` rebuilds a cached library whose fingerprint differs from
the scenario at hand, naming the parts that changed (a library built before fingerprints counts as changed).
Prices are not part of it: no template depends on them (they are the online stage's input, read at every plan;
the library keeps the build-time prices in its `prices` meta for reports only)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coral.catalog.loader import Catalog, load_scenario, market_catalog
from coral.catalog.schema import Scenario
from coral.perf.roofline import RooflineModel
from coral.templates.library import LIBRARY_FORMAT, TemplateLibrary


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


def changed_parts(library: TemplateLibrary, scenario: Scenario, catalog: Catalog | None = None,
                  perf: RooflineModel | None = None) -> list[str]:
    """The fingerprint parts in which `library` differs from `scenario` (all of them when it records none). A
    library built with custom perf parameters (`coral templates build --perf-params`) is compared on the others
    only: it is used as built (rebuild it with the same option)."""
    want = fingerprint(scenario, catalog, perf)
    have = json.loads(library.meta.get("fingerprint", "{}"))
    custom = perf is None and library.meta.get("perf_source") == "custom"
    return [k for k in want if have.get(k) != want[k] and not (custom and k == "perf")]


def load_library(scenario: str, out: Path, catalog: Catalog | None = None) -> TemplateLibrary:
    """The scenario's library from `out/<scenario>.templates.sqlite`; built and cached when missing, rebuilt
    (saying which inputs changed) when its fingerprint differs from the scenario's."""
    from coral.templates.build import build_library

    sc = load_scenario(scenario, catalog)
    path = out / f"{Path(scenario).stem}.templates.sqlite"
    if path.exists():
        lib = TemplateLibrary.load(path)
        changed = changed_parts(lib, sc, catalog)
        if not changed:
            return lib
        print(f"{path}: built for other inputs ({', '.join(changed)} changed); rebuilding", file=sys.stderr)
    lib = build_library(sc, catalog, workers=os.cpu_count(), progress=True)
    lib.save(path)
    return lib
