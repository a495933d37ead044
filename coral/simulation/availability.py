"""Node availability over time: a schedule file (YAML/JSON) or a CSV trace of per-region, per-config counts."""

from __future__ import annotations

import csv
from pathlib import Path

from coral.allocation.availability import PLENTY
from coral.catalog.loader import CoralInputError, check_region_table, load_file, validate
from coral.catalog.schema import AvailabilitySchedule, Scenario


def check_schedule(schedule: AvailabilitySchedule, scenario: Scenario, source: str) -> None:
    """Every region and config a schedule names must be in the scenario."""
    for i, s in enumerate(schedule.steps):
        check_region_table(s.counts, scenario, f"{source}: steps.{i}.counts")
        check_region_table(s.prices, scenario, f"{source}: steps.{i}.prices")


def counts_in_force(schedule: AvailabilitySchedule, base: dict[str, dict[str, int]] | str, scenario: Scenario,
                    t: float) -> dict[str, dict[str, int]]:
    """Node counts per region and config of `scenario` at `t`: `base` (the scenario's availability; "unlimited":
    `PLENTY` each) overridden by every step at or before `t`. Before the first step, and for (region, config)s no
    step lists, the base is in force."""
    table = {r: {c: PLENTY if isinstance(base, str) else base.get(r, {}).get(c, 0) for c in scenario.configs}
             for r in scenario.regions}
    for region, counts in schedule.at(t).items():
        table.setdefault(region, {}).update(counts)
    return table


def load_availability(path: str | Path, scenario: Scenario | None = None) -> AvailabilitySchedule:
    """A schedule from YAML/JSON, or from a CSV trace with columns time_s,region,config,count."""
    path = Path(path)
    sched = _from_csv(path) if path.suffix == ".csv" else load_file(AvailabilitySchedule, path)
    if scenario is not None:
        check_schedule(sched, scenario, str(path))
    return sched


def _from_csv(path: Path) -> AvailabilitySchedule:
    need = ("time_s", "region", "config", "count")
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in need if c not in (reader.fieldnames or [])]
            if missing:
                raise CoralInputError(f"{path}: missing column(s) {', '.join(missing)}")
            by_time: dict[float, dict[str, dict[str, int]]] = {}
            for line, row in enumerate(reader, start=2):
                try:
                    t, n = float(row["time_s"]), int(row["count"])
                except ValueError as exc:
                    raise CoralInputError(f"{path}:{line}: time_s/count: {exc}") from exc
                by_time.setdefault(t, {}).setdefault(row["region"], {})[row["config"]] = n
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc
    if not by_time:
        raise CoralInputError(f"{path}: no rows")
    steps = [{"at_s": t, "counts": c} for t, c in sorted(by_time.items())]
    return validate(AvailabilitySchedule, {"steps": steps}, str(path))
