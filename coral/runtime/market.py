"""The market a running controller plans in, re-read while it runs: a market file (YAML/JSON) or an http(s) URL
publishing a `MarketSnapshot` (offerings with their prices, and the nodes available per region and config).
`MarketWatcher` re-reads it every `poll_s`; when what it publishes changes, it calls `on_change` (the
controller's `trigger`, so the next plan is made at once) and the planner plans in it (`apply`)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog, validate
from coral.catalog.schema import MarketSnapshot, Scenario
from coral.simulation.engine import ObservedDemand


def read_market(location: str, scenario: Scenario, timeout_s: float = 5.0) -> tuple[MarketSnapshot, str]:
    """The snapshot at `location` (a path, or an http:// / https:// URL), checked against the scenario (every
    GPU known, every region and config of its availability in the scenario), and a digest of its content."""
    try:
        if location.startswith(("http://", "https://")):
            response = httpx.get(location, timeout=timeout_s)
            response.raise_for_status()
            text = response.text
        else:
            text = Path(location).read_text()
        data = yaml.safe_load(text)
    except (OSError, httpx.HTTPError, yaml.YAMLError) as exc:
        raise CoralInputError(f"{location}: cannot read the market: {exc}") from None
    snap = validate(MarketSnapshot, data, location)
    known = builtin_catalog().gpus
    for i, o in enumerate(snap.offerings or []):
        if o.gpu not in known:
            raise CoralInputError(f"{location}: offerings.{i}.gpu: unknown GPU {o.gpu!r}")
    for region, cfgs in (snap.availability or {}).items():
        if region not in scenario.regions:
            raise CoralInputError(f"{location}: availability.{region}: not a region of {scenario.name}")
        for cfg in cfgs:
            if cfg not in scenario.configs:
                raise CoralInputError(f"{location}: availability.{region}.{cfg}: not a config of {scenario.name}")
    return snap, hashlib.sha256(snap.model_dump_json().encode()).hexdigest()


class MarketWatcher:
    """Keeps the latest market published at `location` (see the module doc). A read that fails keeps the
    previous market and records the error in `error` (the first read must succeed)."""

    def __init__(self, location: str, scenario: Scenario, base: Catalog, poll_s: float = 60.0,
                 on_change: Callable[[], None] | None = None) -> None:
        if poll_s <= 0:
            raise CoralInputError("market poll interval: must be > 0 s")
        self.location, self.scenario, self.base, self.poll_s = location, scenario, base, poll_s
        self.on_change = on_change
        self.error = ""
        self.changes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.snapshot, self._digest = read_market(location, scenario)

    def poll(self) -> bool:
        """Read the market once; True when it changed (then `on_change` has been called)."""
        try:
            snap, digest = read_market(self.location, self.scenario)
        except CoralInputError as exc:
            self.error = str(exc)
            return False
        self.error = ""
        with self._lock:
            if digest == self._digest:
                return False
            self.snapshot, self._digest = snap, digest
            self.changes += 1
        if self.on_change is not None:
            self.on_change()
        return True

    def catalog(self) -> Catalog:
        """The catalog with the published offerings (the base catalog's where none are published)."""
        with self._lock:
            offers = self.snapshot.offerings
        return self.base if offers is None else self.base.with_offerings(list(offers))

    def apply(self, observed: ObservedDemand) -> ObservedDemand:
        """`observed` with the published availability and offerings in force (what a re-planner plans in)."""
        with self._lock:
            avail = self.snapshot.availability
        return dataclasses.replace(observed, availability=avail if avail is not None else observed.availability,
                                   market=self.catalog())

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def start(self) -> MarketWatcher:
        self._thread = threading.Thread(target=self._loop, name="coral-market", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
