"""The market a running controller plans in, re-read while it runs: a market file (YAML/JSON) or an http(s) URL
publishing a `MarketSnapshot` (offerings with their prices, and the nodes available per region and config).
`MarketWatcher` re-reads it every `poll_s`; when what it publishes changes, it calls `on_change` (the
controller's `trigger`, so the next plan is made at once) and the planner plans in it (`apply`)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable

import httpx

from coral.catalog.loader import (
    Catalog,
    CoralInputError,
    check_region_table,
    offerings_catalog,
    parse_structured,
    read_input_text,
    validate,
)
from coral.catalog.schema import MarketSnapshot, Scenario
from coral.simulation.engine import ObservedDemand


def read_market(location: str, scenario: Scenario, base: Catalog, timeout_s: float = 5.0
                ) -> tuple[MarketSnapshot, Catalog, str]:
    """The snapshot at `location` (a path, or an http:// / https:// URL), checked against the scenario (every
    GPU known, every region and config of its availability in the scenario); `base` with the offerings it
    publishes (`base` itself where it publishes none); and a digest of its content."""
    try:
        if location.startswith(("http://", "https://")):
            response = httpx.get(location, timeout=timeout_s)
            response.raise_for_status()
            text = response.text
        else:
            text = read_input_text(location)
    except (OSError, httpx.HTTPError) as exc:
        raise CoralInputError(f"{location}: cannot read the market: {exc}") from None
    data = parse_structured(text, location)
    snap = validate(MarketSnapshot, data, location)
    catalog = base if snap.offerings is None else offerings_catalog(snap.offerings, location, base)
    check_region_table(snap.availability or {}, scenario, f"{location}: availability")
    return snap, catalog, hashlib.sha256(snap.model_dump_json().encode()).hexdigest()


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
        self.snapshot, self._catalog, self._digest = read_market(location, scenario, base)

    def poll(self) -> bool:
        """Read the market once; True when it changed (then `on_change` has been called)."""
        try:
            snap, catalog, digest = read_market(self.location, self.scenario, self.base)
        except CoralInputError as exc:
            self.error = str(exc)
            return False
        self.error = ""
        with self._lock:
            if digest == self._digest:
                return False
            self.snapshot, self._catalog, self._digest = snap, catalog, digest
            self.changes += 1
        if self.on_change is not None:
            self.on_change()
        return True

    def catalog(self) -> Catalog:
        """The catalog with the published offerings (the base catalog's where none are published)."""
        with self._lock:
            return self._catalog

    def apply(self, observed: ObservedDemand) -> ObservedDemand:
        """`observed` with the published availability and offerings in force (what a re-planner plans in)."""
        with self._lock:
            avail, catalog = self.snapshot.availability, self._catalog
        return dataclasses.replace(observed, availability=avail if avail is not None else observed.availability,
                                   market=catalog)

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
