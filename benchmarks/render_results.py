"""Render the documentation's results pages from the JSON the benchmarks and experiments write.

    python benchmarks/render_results.py [--from out/benchmarks out/experiments] [--data docs/results/data]
                                        [--pages docs/results]

Copies every `*.json` of the `--from` folders into `--data` (`benchmarks/` and `experiments/` below it, so the
pages can be rendered again from what is kept there), then writes, from `--data` alone:

- `experiments.md`: every `coral experiment NAME` result (`out/experiments/NAME.json`): the paper's experiments,
  the scarce-market tables among them;
- `equal-attainment.md`: `benchmarks/equal_attainment.py` (`out/benchmarks/equal_attainment*.json`);
- `benchmarks.md`: every other benchmark's JSON, as tables of its fields.

Every table states the commit, date, machine and load recorded beside its figures (the `meta` key the benchmarks
write through `benchmarks/_console.py`), or says that they were not recorded. A page with no JSON says which
command produces it. Nothing is measured here, and no figure is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

GENERATED = ("<!-- Rendered by `python benchmarks/render_results.py` from the JSON in docs/results/data/; "
             "edit the renderer, not this page. -->")
NOT_RECORDED = "commit, date, machine and load: not recorded in this JSON"

#: the command that writes each benchmark's JSON (out/benchmarks/<name>.json unless said otherwise)
BENCHMARK_COMMANDS = {
    "allocator": "python benchmarks/allocator.py --replan",
    "attention": "python benchmarks/attention.py",
    "certification": "python benchmarks/certification.py out/benchmarks/ea_core.plans/*.json --scenario core",
    "certification.extended": "python benchmarks/certification.py out/benchmarks/ea_extended.plans/*.json "
                              "--scenario extended --json out/benchmarks/certification.extended.json",
    "classes": "python benchmarks/classes.py",
    "cluster": "python benchmarks/cluster.py",
    "emulated_fidelity": "python benchmarks/emulated_fidelity.py --duration 30",
    "engine": "python benchmarks/engine.py --vllm --no-hops",
    "engine_load": "python benchmarks/engine_load.py",
    "fidelity": "python benchmarks/fidelity.py --runs 2",
    "gateway": "python benchmarks/gateway.py --requests 100 --repeats 2 --rates 200 --seconds 2",
    "gpu_engine": "python benchmarks/gpu_engine.py (on a CUDA GPU; writes out/benchmarks/gpu_engine/gpu_engine.json)",
    "latency_rating": "python benchmarks/latency_rating.py",
    "online": "python benchmarks/online.py",
    "perf_fidelity": "python benchmarks/perf_fidelity.py",
    "reliability": "python benchmarks/reliability.py",
    "request_sets": "python benchmarks/request_sets.py",
    "scarce_split": "python benchmarks/scarce_split.py",
    "shedding": "python benchmarks/shedding.py",
    "shedding_runtime": "python benchmarks/shedding_runtime.py --before 10 --after 60",
    "simulator": "python benchmarks/simulator.py",
    "templates": "python benchmarks/templates.py --workers 2",
}
EXPERIMENT_COMMANDS = [
    "coral experiment scarce core", "coral experiment scarce extended", "coral experiment imbalanced core",
    "coral experiment imbalanced extended", "coral experiment below", "coral experiment epochs",
    "coral experiment waterfall",
]
EQUAL_ATTAINMENT_COMMANDS = [
    "python benchmarks/equal_attainment.py --scenario core --target 0.9 0.99 --method coral homo-ilp "
    "--setting default best-gpu-4 --name ea_core",
    "python benchmarks/equal_attainment.py --scenario extended --target 0.9 0.99 --method coral homo-ilp "
    "--setting default --name ea_extended",
    "python benchmarks/equal_attainment.py --merge out/benchmarks/ea_core.json out/benchmarks/ea_extended.json",
]
MAX_ROWS = 80


# ----------------------------------------------------------------------------------------------------------------
# formatting


def fmt(value: Any) -> str:
    """One table cell: numbers to 4 significant digits with thousands separators, shares as given, `–` for none."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) < 1e-3:
            return f"{value:.3g}"
        digits = max(0, 3 - math.floor(math.log10(abs(value))))
        return f"{value:,.{min(digits, 6)}f}"
    if isinstance(value, Mapping):
        return "; ".join(f"{k}: {fmt(v)}" for k, v in value.items()) or "–"
    if isinstance(value, list | tuple):
        return ", ".join(fmt(v) for v in value) if len(value) <= 12 else f"{len(value)} values"
    return " ".join(str(value).split()).replace("|", "\\|")


def pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.1f} %"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, row in enumerate(rows):
        if i == MAX_ROWS:
            out.append("| " + " | ".join([f"… (first {MAX_ROWS} rows shown)"] + [""] * (len(columns) - 1)) + " |")
            break
        out.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return [*out, ""]


def meta_line(meta: Mapping[str, Any] | None) -> str:
    """Where and when: commit, date, machine, load, command; or that the JSON does not say."""
    if not meta:
        return NOT_RECORDED
    commit = str(meta.get("commit") or "unknown commit")[:10]
    if meta.get("dirty"):
        commit += " with uncommitted changes"
    m = meta.get("machine") or {}
    machine = ", ".join(str(x) for x in (
        m.get("host"), m.get("cpu"), f"{m['cores']} cores" if m.get("cores") else None,
        f"{m['memory_gb']} GB" if m.get("memory_gb") else None, m.get("gpus") or "no GPU") if x)
    load = meta.get("load_average")
    loads = " / ".join(f"{x:g}" for x in load) if load else "not recorded"
    command = f"; `{meta['command']}`" if meta.get("command") else ""
    return (f"commit {commit}; {meta.get('date') or 'date not recorded'}; machine: {machine or 'not recorded'}; "
            f"load average (1 / 5 / 15 min): {loads}{command}")


# ----------------------------------------------------------------------------------------------------------------
# pages


def render_equal_attainment(docs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """The equal-attainment table: every method's cheapest plan meeting every target, scored on held-out traffic."""
    out: list[str] = []
    for name, doc in docs:
        rows = list(doc.get("rows", []))
        runs: list[str] = []
        cells = []
        for r in rows:
            key = (r.get("scenario"), r.get("setting"), r.get("target"))
            coral = next((c for c in rows if (c.get("scenario"), c.get("setting"), c.get("target")) == key
                          and c.get("method") == "coral"), None)
            cost, met = r.get("cost_per_hour"), r.get("met_held_out")
            ratio = ("–" if not met or cost is None or coral is None or not coral.get("cost_per_hour")
                     else f"{cost / coral['cost_per_hour']:.3f}×")
            line = meta_line(r.get("meta") or doc.get("meta"))
            if line not in runs:
                runs.append(line)
            held, worst = r.get("held_out") or {}, r.get("held_out_worst") or {}
            bound = [float(c) for c in (r.get("certified") or {}).values() if isinstance(c, int | float)]
            cells.append([fmt(r.get("scenario")), fmt(r.get("setting")), pct(r.get("target")),
                          fmt(r.get("method")) + ("" if met else " (misses)"), fmt(cost), ratio,
                          pct(min(bound)) if bound else "–",
                          pct(min(held.values())) if held else "–", pct(min(worst.values())) if worst else "–",
                          fmt(r.get("heterogeneous_instances")), fmt(r.get("rounds")), fmt(r.get("chosen_trial")),
                          "yes" if r.get("safety_net") else "no", f"run {runs.index(line) + 1}"])
        out += [f"## `{name}`", ""]
        out += table(["scenario", "market", "target", "method", "$/h", "× Coral", "certified bound, least model",
                      "held-out pooled, least model", "worst window, least model", "mixed instances", "rounds", "plan from", "safety net hit",
                      "measured"], cells)
        out += ["Runs:", ""] + [f"{i}. {line}" for i, line in enumerate(runs, 1)] + [""]
    return out


def render_experiment(name: str, doc: Mapping[str, Any]) -> list[str]:
    """A `coral experiment` result: its title, its own columns over its rows, its notes."""
    out = [f"## {doc.get('title') or name}", "", f"`{name}.json` — {meta_line(doc.get('meta'))}", ""]
    rows = [r for r in doc.get("rows", []) if isinstance(r, Mapping)]
    columns = list(doc.get("columns") or (list(rows[0]) if rows else []))
    if rows:
        out += table(columns, ([r.get(c) for c in columns] for r in rows))
    notes = doc.get("notes") or []
    out += [f"- {fmt(n)}" for n in notes] + ([""] if notes else [])
    return out


def _scalars(doc: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Scalar (and short list) fields of `doc`, nested mappings flattened as `a.b`."""
    out: list[tuple[str, Any]] = []
    for k, v in doc.items():
        if k == "meta":
            continue
        if isinstance(v, Mapping) and not any(isinstance(x, list | Mapping) for x in v.values()):
            out += [(f"{prefix}{k}.{kk}", vv) for kk, vv in v.items()]
        elif isinstance(v, Mapping):
            out += _scalars(v, f"{prefix}{k}.")
        elif not (isinstance(v, list) and v and isinstance(v[0], Mapping)):
            out.append((f"{prefix}{k}", v))
    return out


def _row_tables(doc: Mapping[str, Any], prefix: str = "") -> list[tuple[str, list[Mapping[str, Any]]]]:
    out: list[tuple[str, list[Mapping[str, Any]]]] = []
    for k, v in doc.items():
        if isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            out.append((f"{prefix}{k}", v))
        elif isinstance(v, Mapping) and k != "meta":
            out += _row_tables(v, f"{prefix}{k}.")
    return out


def _flat(row: Mapping[str, Any]) -> dict[str, Any]:
    """A record with its nested mappings of scalars spread into `key.sub` columns."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, Mapping) and v and not any(isinstance(x, list | Mapping) for x in v.values()):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        elif k != "meta":
            out[k] = v
    return out


def render_generic(name: str, doc: Mapping[str, Any]) -> list[str]:
    """Any benchmark's JSON: its scalar fields, then one table per list of records."""
    command = BENCHMARK_COMMANDS.get(name.split("-")[0], f"the benchmark that writes {name}.json")
    out = [f"## `{name}.json`", "", f"Written by `{command}` — {meta_line(doc.get('meta'))}", ""]
    scalars = _scalars(doc)
    if scalars:
        out += table(["field", "value"], ([f"`{k}`", fmt(v)] for k, v in scalars))
    for key, records in _row_tables(doc):
        rows = [_flat(r) for r in records]
        columns = list(dict.fromkeys(c for r in rows for c in r))
        out += [f"`{key}`:", ""]
        out += table(columns, ([r.get(c) for c in columns] for r in rows))
    return out


def _load(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: not JSON: {exc}") from exc
        docs.append((path.stem, doc if isinstance(doc, dict) else {"rows": doc}))
    return docs


def _page(title: str, intro: str, body: list[str], commands: Sequence[str]) -> str:
    head = [GENERATED, "", f"# {title}", "", intro, ""]
    if not body:
        head += ["No results are recorded in `docs/results/data/` yet. Produce them, then run "
                 "`python benchmarks/render_results.py`:", "", "```bash", *commands, "```", ""]
    else:
        head += ["Reproduce them with:", "", "```bash", *commands, "python benchmarks/render_results.py", "```", ""]
    return "\n".join(head + body).rstrip() + "\n"


def render_pages(data: Path) -> dict[str, str]:
    """{page file name: markdown} of the three results pages, from the JSON kept under `data`."""
    bench = _load(data / "benchmarks")
    exps = _load(data / "experiments")
    equal = [(n, d) for n, d in bench if n.startswith("equal_attainment")]
    others = [(n, d) for n, d in bench if not n.startswith("equal_attainment") and n != "previous"]
    return {
        "experiments.md": _page(
            "The paper's experiments",
            "`coral experiment NAME` runs one of the paper's experiments (`scarce`: scarce markets, the paper's §6.4; "
            "`imbalanced`: §6.5; `below`: availability below the estimate; `epochs`; `waterfall`: from the paper's "
            "setting to ours) and writes `out/experiments/NAME.json`. Each method is searched to the same "
            "attainment target and scored on held-out traffic; the tables show each experiment's own columns.",
            [line for n, d in exps for line in render_experiment(n, d)], EXPERIMENT_COMMANDS),
        "equal-attainment.md": _page(
            "Methods at equal attainment",
            "`benchmarks/equal_attainment.py` gives every method the same search (same library, market, traffic, "
            "tuning and held-out requests) and records each method's cheapest plan meeting every model's target. "
            "× Coral is $/h ÷ Coral's in the same scenario, market and target; a method missing a target on "
            "held-out traffic gets no ratio. Markets: *default* is the scenario's own; *best-gpu-N* a market of "
            "N GPUs of the scenario's best type in all, every weaker type as plentiful as asked.",
            render_equal_attainment(equal), EQUAL_ATTAINMENT_COMMANDS),
        "benchmarks.md": _page(
            "Performance benchmarks",
            "Every other benchmark under `benchmarks/`, each rendered from the JSON it wrote: its fields, then its "
            "tables of records.",
            [line for n, d in others for line in render_generic(n, d)],
            [c for c in BENCHMARK_COMMANDS.values() if "(" not in c]),
    }


def collect(sources: Sequence[Path], data: Path) -> list[Path]:
    """Copy the JSON of each source folder into `data/benchmarks` or `data/experiments` (by the folder's name)."""
    copied = []
    for src in sources:
        if not src.is_dir():
            continue
        kind = "experiments" if "experiment" in src.name else "benchmarks"
        (data / kind).mkdir(parents=True, exist_ok=True)
        for path in sorted(src.glob("*.json")):
            shutil.copy2(path, data / kind / path.name)
            copied.append(data / kind / path.name)
    return copied


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="sources", nargs="*", type=Path,
                    default=[Path("out/benchmarks"), Path("out/experiments")],
                    help="folders of JSON to copy in first (none: render from --data alone)")
    ap.add_argument("--data", type=Path, default=Path("docs/results/data"))
    ap.add_argument("--pages", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    copied = collect(args.sources, args.data)
    args.pages.mkdir(parents=True, exist_ok=True)
    for name, text in render_pages(args.data).items():
        (args.pages / name).write_text(text)
        print(f"wrote {args.pages / name}")
    print(f"{len(copied)} JSON file(s) copied into {args.data}")


if __name__ == "__main__":
    main()
