"""Node availability over time: a schedule file (YAML/JSON) or a CSV trace of per-region, per-config counts."""

from __future__ import annotations

import csv
from pathlib import Path

from coral.catalog.loader import CoralInputError, load_file, validate
from coral.catalog.schema import AvailabilitySchedule, Scenario


def check_schedule(schedule: AvailabilitySchedule, scenario: Scenario, source: str) -> None:
    """Every region and config a schedule names must be in the scenario."""
    for i, s in enumerate(schedule.steps):
        for field, table in (("counts", s.counts), ("prices", s.prices)):
            for region, cfgs in table.items():
                if region not in scenario.regions:
                    raise CoralInputError(f"{source}: steps.{i}.{field}: region {region!r} is not in the scenario")
                for cfg in cfgs:
                    if cfg not in scenario.configs:
                        raise CoralInputError(f"{source}: steps.{i}.{field}.{region}: config {cfg!r} not in scenario")


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
