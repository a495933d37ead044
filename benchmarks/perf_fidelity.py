"""Fidelity of the roofline perf model against Helix's measured per-layer LLaMA-2 70B profiles.

    python benchmarks/perf_fidelity.py [--profiles DIR]

For every (config, phase): median and worst |predicted / measured - 1| over the measured batches with
  - before: the pre-calibration defaults (one compute 0.55 / memory 0.80 / interconnect 0.70 for every GPU, KV
    read at the memory efficiency, a layer's time the max of its compute and memory times),
  - shipped: coral/data/perf_defaults.yaml,
  - in-sample: calibrated on all rows (what `coral perf calibrate` does), with the shipped compute_memory_blend,
  - hold-out interleaved: calibrated on every other batch of each file, scored on the others,
  - hold-out extrapolation: calibrated on the smallest 60% of batches of each file, scored on the largest 40%,
  - hold-out config: each config of a GPU measured in several configs, from a fit on the GPU's other configs,
  - roofline max: calibrated (in-sample) with a layer's time the max of its compute and memory times instead of
    the shipped `compute_memory_blend` (their 2-norm), as shipped before 2026-12-04.
And "shipped, beyond rounding": the shipped model's error outside each row's rounding interval (Helix writes some
rows to 0.1 ms and most of the larger ones to whole ms: a row of 3 ms means 2.5-3.5 ms), i.e.
max(0, |predicted - measured| - half the row's last digit) / measured. And "monotone floor": the smallest worst |predicted / measured - 1| that ANY model whose step time does not fall
as the batch grows can reach on the file (a lower bound for the worst column of every such model, the roofline
included; above 0 where the measurements fall with the batch).
Prints a table and writes out/benchmarks/perf_fidelity.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.catalog.loader import builtin_catalog, data_path
from coral.perf import PerfParams, RooflineModel
from coral.perf.measured import PROFILE_FILES, ProfileSet, calibrate, error_summary, relative_errors

PRE_CALIBRATION = {"compute_efficiency": 0.55, "memory_efficiency": 0.80, "attention_efficiency": 0.80,
                   "interconnect_efficiency": 0.70, "gpu_overrides": {}, "gpu_fallbacks": {},
                   "compute_memory_blend": None}


def monotone_floor(seconds: np.ndarray) -> float:
    """Least ε such that some non-decreasing f has |f_i / t_i - 1| ≤ ε at every point (t in batch order):
    bisection on ε, each ε checked greedily (f_i = max(f_{i-1}, t_i (1 - ε)) must stay ≤ t_i (1 + ε))."""
    def feasible(eps: float) -> bool:
        f = 0.0
        for t in seconds:
            f = max(f, t * (1 - eps))
            if f > t * (1 + eps):
                return False
        return True

    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def half_resolution_s(path: Path) -> dict[float, float]:
    """Batch -> half the last written digit of its time (s), from the raw `batch,ms` rows of a Helix file."""
    out = {}
    for line in path.read_text().split():
        batch, _, ms = line.partition(",")
        decimals = len(ms.partition(".")[2])
        if float(batch) > 0:
            out[float(batch)] = 0.5 * 10.0 ** -decimals / 1e3
    return out


def beyond_rounding(pset: ProfileSet, folder: Path, errors: dict) -> dict:
    """Per (config, phase): (median, worst) of max(0, |predicted - measured| - half resolution) / measured."""
    folder_of = {config: name for name, config in pset.manifest.configs.items()}
    out = {}
    for (config, phase), e in errors.items():
        prof = pset.profiles[(config, phase)]
        half = half_resolution_s(folder / folder_of[config] / PROFILE_FILES[phase])
        h = np.array([half[float(b)] for b in prof.tokens])
        out[(config, phase)] = error_summary(np.maximum(0.0, np.abs(e) * prof.seconds - h) / prof.seconds)
    return out


def held_out_configs(pset: ProfileSet, fitted: Callable[[ProfileSet], RooflineModel],
                     scored: Callable[[RooflineModel], dict]) -> dict:
    """Each config of a GPU with several measured configs, predicted from a fit on the GPU's other configs
    (e.g. 4xT4 from 1xT4 and 2xT4: tests the tensor-parallel part of the model)."""
    cat = builtin_catalog()
    gpu = {config: cat.node_config(config).gpu.name for config, _ in pset.profiles}
    out = {}
    for config in sorted(set(gpu)):
        others = {k: p for k, p in pset.profiles.items() if k[0] != config and gpu[k[0]] == gpu[config]}
        if others:
            pm = fitted(ProfileSet(others, pset.manifest))
            out.update({k: v for k, v in scored(pm).items() if k[0] == config})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", type=Path, default=data_path("profiles", "helix-llama2-70b"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    cat = builtin_catalog()
    pset = ProfileSet.read(args.profiles, catalog=cat)
    man = pset.manifest
    assert man.model and man.workload, "the profile folder needs a profile.yaml with model and workload"
    model, w = cat.model(man.model), man.workload
    before = RooflineModel(PerfParams.load().model_copy(update=PRE_CALIBRATION))

    shipped = RooflineModel()
    start = RooflineModel(before.params.model_copy(update={"compute_memory_blend": shipped.params.compute_memory_blend}))

    def fitted(train: ProfileSet, base: RooflineModel = start) -> RooflineModel:
        params, _ = calibrate(base, model, train, w, "benchmark", cat)
        return RooflineModel(params)

    def scored(pm: RooflineModel, keep: dict | None = None) -> dict:
        errs = relative_errors(pm, model, pset if keep is None else pset.subset(keep), w, cat)
        return {k: error_summary(e) for k, e in errs.items()}

    idx = {k: np.arange(len(p.tokens)) for k, p in pset.profiles.items()}
    even = {k: i % 2 == 0 for k, i in idx.items()}
    small = {k: i < int(np.ceil(0.6 * len(i))) for k, i in idx.items()}
    max_fit = fitted(pset, before)  # a layer's time the max of compute and memory, as before the blend
    columns = {
        "before": scored(before),
        "shipped": scored(shipped),
        "shipped, beyond rounding": beyond_rounding(pset, args.profiles, relative_errors(shipped, model, pset, w, cat)),
        "in-sample": scored(fitted(pset)),
        "hold-out interleaved": scored(fitted(pset.subset(even)), {k: ~v for k, v in even.items()}),
        "hold-out extrapolation": scored(fitted(pset.subset(small)), {k: ~v for k, v in small.items()}),
        "hold-out config": held_out_configs(pset, fitted, scored),
        "roofline max, in-sample": scored(max_fit),
        "roofline max, beyond rounding": beyond_rounding(
            pset, args.profiles, relative_errors(max_fit, model, pset, w, cat)),
    }
    floor = {k: monotone_floor(p.seconds) for k, p in pset.profiles.items()}

    columns = {name: col for name, col in columns.items() if col}
    table = Table(title=f"{man.model}: per-layer |predicted/measured - 1|, median / worst")
    table.add_column("config")
    table.add_column("phase")
    for name in columns:
        table.add_column(name, justify="right")
    table.add_column("monotone floor (worst)", justify="right")
    rows = []
    for key in pset.profiles:
        cells = {name: col.get(key) for name, col in columns.items()}
        table.add_row(key[0], str(key[1]), *(f"{c[0]:.1%} / {c[1]:.1%}" if c else "-" for c in cells.values()),
                      f"{floor[key]:.1%}")
        rows.append({"config": key[0], "phase": str(key[1]), "points": len(pset.profiles[key].tokens),
                     "monotone_floor_worst": floor[key],
                     **{name: {"median": c[0], "worst": c[1]} for name, c in cells.items() if c}})
    summary = {name: {"median of medians": float(np.median([m for m, _ in col.values()])),
                      "max of medians": float(max(m for m, _ in col.values())),
                      "max of worst": float(max(x for _, x in col.values())),
                      "pairs with worst <= 20%": sum(x <= 0.2 for _, x in col.values()),
                      "pairs": len(col)} for name, col in columns.items()}
    table.add_section()
    table.add_row("all", "median of medians", *(f"{s['median of medians']:.1%}" for s in summary.values()))
    table.add_row("all", "max of medians", *(f"{s['max of medians']:.1%}" for s in summary.values()))
    table.add_row("all", "max of worst", *(f"{s['max of worst']:.1%}" for s in summary.values()),
                  f"{max(floor.values()):.1%}")
    table.add_row("all", "worst <= 20%", *(f"{s['pairs with worst <= 20%']} of {s['pairs']}" for s in summary.values()),
                  f"{sum(x <= 0.2 for x in floor.values())} of {len(floor)}")
    table_console().print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "perf_fidelity.json"
    path.write_text(stamped_json({"profiles": str(args.profiles), "model": man.model,
                                "workload": {"input_tokens": w.input_tokens, "output_tokens": w.output_tokens},
                                "rows": rows, "summary": summary,
                                "monotone_floor_max_worst": max(floor.values())}, indent=2))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
