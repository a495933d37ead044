"""The Serving Template Library: templates in memory (numpy columns) and on disk (one SQLite file)."""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coral.catalog.loader import CoralInputError
from coral.perf.model import Phase

LIBRARY_FORMAT = 1


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: `layers` consecutive layers held by every node in `nodes` (data parallel)."""

    layers: int
    nodes: tuple[str, ...]
    node_throughput: tuple[float, ...]

    @property
    def throughput(self) -> float:
        return float(sum(self.node_throughput))


@dataclass(frozen=True)
class Template:
    """A node combination of one region with its throughput-optimal placement for (model, phase, SLO)."""

    id: int
    model: str
    phase: Phase
    slo_ms: float
    counts: dict[str, int]
    stages: tuple[Stage, ...]
    throughput: float

    @property
    def n_nodes(self) -> int:
        return sum(self.counts.values())

    def cost(self, prices: dict[str, float]) -> float:
        """$/h in a region; inf when a config is not offered there."""
        return float(sum(n * prices.get(c, float("inf")) for c, n in self.counts.items()))

    def layer_ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for s in self.stages:
            out.append((start, start + s.layers))
            start += s.layers
        return out


def layout_to_json(stages: Sequence[Stage]) -> str:
    return json.dumps([[s.layers, list(s.nodes), [round(t, 6) for t in s.node_throughput]] for s in stages])


def layout_from_json(text: str) -> tuple[Stage, ...]:
    return tuple(Stage(layers=int(lay), nodes=tuple(nodes), node_throughput=tuple(thr))
                 for lay, nodes, thr in json.loads(text))


@dataclass
class TemplateLibrary:
    """Column store of templates; row i is template id i."""

    configs: list[str]
    model: np.ndarray  # object array of model names
    phase: np.ndarray  # object array of phase names
    slo_ms: np.ndarray
    throughput: np.ndarray
    counts: np.ndarray  # (N, C) int16
    n_stages: np.ndarray
    layouts: list[str] | None = None  # JSON per row, loaded lazily from `path`
    meta: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    def __len__(self) -> int:
        return int(self.throughput.shape[0])

    @classmethod
    def from_templates(cls, configs: list[str], templates: Iterable[Template], meta: dict[str, str]) -> TemplateLibrary:
        rows = list(templates)
        idx = {c: i for i, c in enumerate(configs)}
        counts = np.zeros((len(rows), len(configs)), dtype=np.int16)
        for r, t in enumerate(rows):
            for c, n in t.counts.items():
                counts[r, idx[c]] = n
        return cls(
            configs=list(configs),
            model=np.array([t.model for t in rows], dtype=object),
            phase=np.array([str(t.phase) for t in rows], dtype=object),
            slo_ms=np.array([t.slo_ms for t in rows], dtype=float),
            throughput=np.array([t.throughput for t in rows], dtype=float),
            counts=counts,
            n_stages=np.array([len(t.stages) for t in rows], dtype=np.int16),
            layouts=[layout_to_json(t.stages) for t in rows],
            meta=dict(meta),
        )

    # --- queries --------------------------------------------------------------------------------------
    def keys(self) -> list[tuple[str, Phase]]:
        seen = dict.fromkeys(zip(self.model.tolist(), self.phase.tolist(), strict=True))
        return [(m, Phase(p)) for m, p in seen]

    def select(self, model: str, phase: Phase | str) -> np.ndarray:
        return np.flatnonzero((self.model == model) & (self.phase == str(phase)))

    def costs(self, prices: dict[str, float]) -> np.ndarray:
        """$/h of every template in a region (inf where a config it uses is not offered)."""
        p = np.array([prices.get(c, np.inf) for c in self.configs])
        with np.errstate(invalid="ignore"):
            cost = np.where(self.counts > 0, self.counts * p, 0.0).sum(axis=1)
        return cost

    def _ensure_layouts(self) -> None:
        if self.layouts is None and self.path is not None:
            self.layouts = _read_layouts(self.path)

    def layout(self, i: int) -> tuple[Stage, ...]:
        self._ensure_layouts()
        if self.layouts is None:
            raise CoralInputError("library has no layouts")
        return layout_from_json(self.layouts[i])

    def template(self, i: int) -> Template:
        counts = {self.configs[c]: int(n) for c, n in enumerate(self.counts[i]) if n}
        return Template(
            id=int(i),
            model=str(self.model[i]),
            phase=Phase(self.phase[i]),
            slo_ms=float(self.slo_ms[i]),
            counts=counts,
            stages=self.layout(i),
            throughput=float(self.throughput[i]),
        )

    def subset(self, rows: np.ndarray) -> TemplateLibrary:
        """A library holding only `rows` (renumbered from 0)."""
        self._ensure_layouts()
        layouts = [self.layouts[i] for i in rows] if self.layouts is not None else None
        return TemplateLibrary(
            configs=list(self.configs),
            model=self.model[rows],
            phase=self.phase[rows],
            slo_ms=self.slo_ms[rows],
            throughput=self.throughput[rows],
            counts=self.counts[rows],
            n_stages=self.n_stages[rows],
            layouts=layouts,
            meta=dict(self.meta),
        )

    # --- disk -----------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write atomically: a temporary file in the same folder, renamed over `path` when complete."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._ensure_layouts()
        if self.layouts is None:
            raise CoralInputError("library has no layouts to save")
        fd, tmp = tempfile.mkstemp(prefix=".coral-lib-", suffix=".sqlite", dir=path.parent)
        os.close(fd)
        try:
            con = sqlite3.connect(tmp)
            con.executescript(
                """
                CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE configs(idx INTEGER PRIMARY KEY, name TEXT NOT NULL);
                CREATE TABLE templates(
                    id INTEGER PRIMARY KEY, model TEXT NOT NULL, phase TEXT NOT NULL, slo_ms REAL NOT NULL,
                    throughput REAL NOT NULL, n_stages INTEGER NOT NULL, counts BLOB NOT NULL, layout TEXT NOT NULL);
                CREATE INDEX templates_key ON templates(model, phase);
                """
            )
            meta = {**self.meta, "format": str(LIBRARY_FORMAT)}
            con.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
            con.executemany("INSERT INTO configs VALUES (?, ?)", enumerate(self.configs))
            counts = self.counts.astype(np.int16)
            con.executemany(
                "INSERT INTO templates VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    (i, self.model[i], self.phase[i], float(self.slo_ms[i]), float(self.throughput[i]),
                     int(self.n_stages[i]), counts[i].tobytes(), self.layouts[i])
                    for i in range(len(self))
                ),
            )
            con.commit()
            con.close()
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> TemplateLibrary:
        """Load the numeric columns; layouts are read on first use."""
        path = Path(path)
        if not path.exists():
            raise CoralInputError(f"{path}: no template library here (build one with `coral templates build`)")
        try:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            meta = dict(con.execute("SELECT key, value FROM meta"))
            configs = [n for _, n in con.execute("SELECT idx, name FROM configs ORDER BY idx")]
            rows = con.execute(
                "SELECT model, phase, slo_ms, throughput, n_stages, counts FROM templates ORDER BY id"
            ).fetchall()
            con.close()
        except sqlite3.DatabaseError as exc:
            raise CoralInputError(f"{path}: not a Coral template library ({exc})") from exc
        if meta.get("format") != str(LIBRARY_FORMAT):
            raise CoralInputError(f"{path}: library format {meta.get('format')!r}, expected {LIBRARY_FORMAT}")
        n, c = len(rows), len(configs)
        if n:
            model, phase, slo, thr, nst, blobs = zip(*rows, strict=True)
            counts = np.frombuffer(b"".join(blobs), dtype=np.int16).reshape(n, c).copy()
        else:
            model = phase = slo = thr = nst = ()
            counts = np.zeros((0, c), dtype=np.int16)
        return cls(
            configs=configs,
            model=np.array(model, dtype=object),
            phase=np.array(phase, dtype=object),
            slo_ms=np.array(slo, dtype=float),
            throughput=np.array(thr, dtype=float),
            counts=counts,
            n_stages=np.array(nst, dtype=np.int16),
            layouts=None,
            meta=meta,
            path=path,
        )


def _read_layouts(path: Path) -> list[str]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    out = [row[0] for row in con.execute("SELECT layout FROM templates ORDER BY id")]
    con.close()
    return out
