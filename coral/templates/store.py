"""Built libraries cached per scenario (`<out>/<scenario>.templates.sqlite`) and what each was built from.

A library records a *fingerprint* of its inputs, one hash per part: the model architectures, the SLOs and mean
request shapes it was rated at, the node configs (GPU specs and network bandwidth), the perf model's parameters,
`n_max`, `rho` and the library format. `load_library` rebuilds a cached library whose fingerprint differs from
the scenario at hand, naming the parts that changed (a library built before fingerprints counts as changed).
Prices are not part of it: no template depends on them (they are the online stage's input, read at every plan;
the library keeps the build-time prices in its `prices` meta for reports only)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from coral.catalog.loader import Catalog, load_scenario
from coral.catalog.schema import Scenario
from coral.perf.roofline import RooflineModel
from coral.templates.fingerprint import fingerprint
from coral.templates.library import TemplateLibrary


def changed_parts(library: TemplateLibrary, scenario: Scenario, catalog: Catalog | None = None,
                  perf: RooflineModel | None = None) -> list[str]:
    """The fingerprint parts in which `library` differs from `scenario` (all of them when it records none). A
    library built with custom perf parameters (`coral templates build --perf-params`) is compared on the others
    only: it is used as built (rebuild it with the same option)."""
    want = fingerprint(scenario, catalog, perf)
    have = json.loads(library.meta.get("fingerprint", "{}"))
    custom = perf is None and library.meta.get("perf_source") == "custom"
    return [k for k in want if have.get(k) != want[k] and not (custom and k == "perf")]


#: (size, seconds on 2 cores) of two builds, size = node combinations of up to n_max nodes x (model, phase)s:
#: core (18,563 x 6) in about 4 s and extended (230,229 x 12) in about 100 s (96 s measured on this project's
#: 2-core machine, numba compiling included), as (size, seconds on 2 cores)
BUILD_REFERENCE = ((111_378, 4.0), (2_762_748, 100.0))


#: seconds numba takes to compile the placement solver when its cache is empty (a fresh clone or machine): a
#: core build took 22.3 s with an empty NUMBA_CACHE_DIR and 4.3 s with a warm one, on this project's 2 cores
COMPILE_S = 18.0


def solver_compiled() -> bool:
    """Whether numba's cache holds the placement solver (else the first build compiles it: `COMPILE_S`)."""
    from coral.templates import placement

    folders = [Path(os.environ["NUMBA_CACHE_DIR"])] if os.environ.get("NUMBA_CACHE_DIR") else []
    folders.append(Path(placement.__file__).parent / "__pycache__")
    return any(any(f.rglob("placement.*.nbi")) for f in folders if f.is_dir())


def build_estimate_s(scenario: Scenario, workers: int | None = None, compiled: bool = True) -> float:
    """Rough seconds a library build of `scenario` takes on `workers` processes (default: every core), from its
    size, on the power law through BUILD_REFERENCE (larger scenarios also have larger models), plus `COMPILE_S`
    unless the solver is `compiled` already."""
    (small, t_small), (large, t_large) = BUILD_REFERENCE
    size = (math.comb(len(scenario.configs) + scenario.n_max, scenario.n_max) - 1) * 2 * len(scenario.models)
    power = math.log(t_large / t_small) / math.log(large / small)
    work = t_small * (size / small) ** power * 2 / max(1, workers or os.cpu_count() or 1)
    return work + (0.0 if compiled else COMPILE_S)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"


def load_library(scenario: str, out: Path, catalog: Catalog | None = None) -> TemplateLibrary:
    """The scenario's library from `out/<scenario>.templates.sqlite`; built and cached when missing, rebuilt
    when its fingerprint differs from the scenario's. Before a build it says on stderr that it builds, why
    (missing, or which inputs changed) and about how long it takes, and shows a progress bar of its placement
    jobs (on a terminal)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    sc = load_scenario(scenario, catalog)
    path = out / f"{Path(scenario).stem}.templates.sqlite"
    why = f"{path} is missing"
    if path.exists():
        lib = TemplateLibrary.load(path)
        changed = changed_parts(lib, sc, catalog)
        if not changed:
            return lib
        why = f"{path} was built for other inputs ({', '.join(changed)} changed)"
    from coral.templates import build  # numba and the placement solver: only when a library is built

    err = Console(stderr=True, soft_wrap=True)
    workers = os.cpu_count() or 1
    compiled = solver_compiled()
    err.print(f"building the template library of {sc.name} ({why}); expected about "
              f"{_duration(build_estimate_s(sc, workers, compiled))} on {workers} cores"
              f"{'' if compiled else ', numba compiling the placement solver first (once per machine)'}; once: it is "
              f"cached in {path}")
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    t0 = time.perf_counter()
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"placement jobs of {sc.name}", total=None)
        lib = build.build_library(sc, catalog, workers=workers,
                                  progress=lambda done, total: bar.update(task, completed=done, total=total))
    lib.save(path)
    err.print(f"built {len(lib):,} templates in {time.perf_counter() - t0:.1f} s (build and save) -> {path}")
    return lib
