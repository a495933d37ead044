"""The Serving Template Library: templates in memory (numpy columns) and on disk (one SQLite file)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from coral.catalog.loader import CoralInputError
from coral.perf.model import Phase
from coral.templates.dominance import undominated

LIBRARY_FORMAT = 1
T = TypeVar("T")


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


@dataclass
class TemplateLibrary:
    """Column store of templates; row i is template id i.

    Layout columns have one slot per node (width = n_max): `nodes` holds the config index of each node (-1 pads),
    `node_stage` its stage, `node_throughput` its tokens/s under the SLO, and `stage_layers` the layers of each
    stage (0 pads). `dominated` marks templates beaten by a sub-multiset of their nodes (no less throughput).
    """

    configs: list[str]
    model: np.ndarray  # object array of model names
    phase: np.ndarray  # object array of phase names
    slo_ms: np.ndarray
    throughput: np.ndarray
    counts: np.ndarray  # (N, C) int16
    nodes: np.ndarray  # (N, W) int16
    node_stage: np.ndarray  # (N, W) int8
    node_throughput: np.ndarray  # (N, W) float64
    stage_layers: np.ndarray  # (N, W) int16
    dominated: np.ndarray  # (N,) bool
    meta: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.throughput.shape[0])

    @property
    def n_stages(self) -> np.ndarray:
        return (self.stage_layers > 0).sum(axis=1)

    @classmethod
    def from_templates(cls, configs: list[str], templates: Iterable[Template], meta: dict[str, str]) -> TemplateLibrary:
        """A library from hand-made or decoded templates (ids are reassigned in order)."""
        rows = list(templates)
        idx = {c: i for i, c in enumerate(configs)}
        width = max((t.n_nodes for t in rows), default=1)
        n = len(rows)
        counts = np.zeros((n, len(configs)), dtype=np.int16)
        nodes = np.full((n, width), -1, dtype=np.int16)
        node_stage = np.zeros((n, width), dtype=np.int8)
        node_thr = np.zeros((n, width))
        layers = np.zeros((n, width), dtype=np.int16)
        for r, t in enumerate(rows):
            for c, k in t.counts.items():
                counts[r, idx[c]] = k
            slot = 0
            for s, st in enumerate(t.stages):
                layers[r, s] = st.layers
                for cfg, thr in zip(st.nodes, st.node_throughput, strict=True):
                    nodes[r, slot], node_stage[r, slot], node_thr[r, slot] = idx[cfg], s, thr
                    slot += 1
        lib = cls(
            configs=list(configs),
            model=np.array([t.model for t in rows], dtype=object),
            phase=np.array([str(t.phase) for t in rows], dtype=object),
            slo_ms=np.array([t.slo_ms for t in rows], dtype=float),
            throughput=np.array([t.throughput for t in rows], dtype=float),
            counts=counts,
            nodes=nodes,
            node_stage=node_stage,
            node_throughput=node_thr,
            stage_layers=layers,
            dominated=np.zeros(n, dtype=bool),
            meta=dict(meta),
        )
        lib.dominated = dominated_rows(lib)
        return lib

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()` computed once per library object and `key` (what the online stage derives from a library
        and reuses on every re-plan: undominated rows, the availability estimate)."""
        if key not in self._memo:
            self._memo[key] = make()
        return cast(T, self._memo[key])

    def content_digest(self) -> str:
        """A short hash of every template (configs and row columns; memoised per library object): what is
        derived from the templates alone is cached under it (`coral.allocation.latency.RatingCache`)."""
        def make() -> str:
            h = hashlib.blake2b(json.dumps(self.configs).encode(), digest_size=16)
            for (model, phase), rows in self.memo("rows_by_key", self._rows_by_key).items():  # model, phase
                h.update(f"{model}/{phase}:".encode())
                h.update(rows.tobytes())
            for name in _ROW_COLUMNS[2:]:
                column = np.ascontiguousarray(getattr(self, name))
                h.update(f"{name}:{column.dtype.str}:{column.shape}".encode())
                h.update(column.data)
            return h.hexdigest()

        return self.memo("content_digest", make)

    # --- queries --------------------------------------------------------------------------------------
    def keys(self) -> list[tuple[str, Phase]]:
        seen = dict.fromkeys(zip(self.model.tolist(), self.phase.tolist(), strict=True))
        return [(m, Phase(p)) for m, p in seen]

    def select(self, model: str, phase: Phase | str, include_dominated: bool = True) -> np.ndarray:
        """Row ids of one (model, phase), ascending (the grouping is computed once per library object)."""
        rows = self.memo("rows_by_key", self._rows_by_key).get((model, str(phase)), np.zeros(0, dtype=np.int64))
        return rows if include_dominated else rows[~self.dominated[rows]]

    def _rows_by_key(self) -> dict[tuple[str, str], np.ndarray]:
        """Rows per (model, phase), from the runs of equal keys (a built library stores each key contiguously)."""
        if not len(self):
            return {}
        edge = np.flatnonzero((self.model[1:] != self.model[:-1]) | (self.phase[1:] != self.phase[:-1])) + 1
        runs: dict[tuple[str, str], list[np.ndarray]] = {}
        for a, b in zip(np.r_[0, edge], np.r_[edge, len(self)], strict=True):
            runs.setdefault((str(self.model[a]), str(self.phase[a])), []).append(np.arange(a, b))
        return {k: np.concatenate(v) for k, v in runs.items()}

    def costs(self, prices: dict[str, float]) -> np.ndarray:
        """$/h of every template in a region (inf where a config it uses is not offered)."""
        p = np.array([prices.get(c, np.inf) for c in self.configs])
        with np.errstate(invalid="ignore"):
            return np.where(self.counts > 0, self.counts * p, 0.0).sum(axis=1)

    def build_prices(self) -> dict[str, dict[str, float]]:
        """The $/node-hour per region and config recorded when the library was built."""
        return {r: dict(p) for r, p in json.loads(self.meta.get("prices", "{}")).items()}

    def region_costs(self) -> tuple[list[str], np.ndarray]:
        """(regions, (N, R) $/h of every template per region at build-time prices; inf where not offered)."""
        prices = self.build_prices()
        regions = sorted(prices)
        if not regions:
            return [], np.zeros((len(self), 0))
        return regions, np.stack([self.costs(prices[r]) for r in regions], axis=1)

    def layout(self, i: int) -> tuple[Stage, ...]:
        n_stages = int((self.stage_layers[i] > 0).sum())
        stages: list[tuple[list[str], list[float]]] = [([], []) for _ in range(n_stages)]
        for slot in range(self.nodes.shape[1]):
            c = int(self.nodes[i, slot])
            if c < 0:
                continue
            s = int(self.node_stage[i, slot])
            stages[s][0].append(self.configs[c])
            stages[s][1].append(float(self.node_throughput[i, slot]))
        return tuple(
            Stage(layers=int(self.stage_layers[i, s]), nodes=tuple(n), node_throughput=tuple(t))
            for s, (n, t) in enumerate(stages)
        )

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
        """A library holding only `rows` (renumbered from 0). The `dominated` flags are kept: they stay exact
        when `rows` keeps every dominator of a kept row (e.g. all single-config rows); otherwise recompute them
        with `dominated_rows`."""
        cols = {name: getattr(self, name)[rows] for name in _ROW_COLUMNS}
        return TemplateLibrary(configs=list(self.configs), meta=dict(self.meta), **cols)

    # --- disk -----------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write one SQLite file atomically (temporary file renamed over `path` when complete)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".coral-lib-", suffix=".sqlite", dir=path.parent)
        os.close(fd)
        try:
            con = sqlite3.connect(tmp)
            con.executescript(
                """
                CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE configs(idx INTEGER PRIMARY KEY, name TEXT NOT NULL);
                CREATE TABLE columns(name TEXT PRIMARY KEY, dtype TEXT NOT NULL, shape TEXT NOT NULL,
                                     data BLOB NOT NULL);
                """
            )
            models = sorted(set(self.model.tolist()))
            meta = {**self.meta, "format": str(LIBRARY_FORMAT), "models": json.dumps(models)}
            con.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
            con.executemany("INSERT INTO configs VALUES (?, ?)", enumerate(self.configs))
            code = {m: i for i, m in enumerate(models)}
            arrays = {name: getattr(self, name) for name in _ROW_COLUMNS if name not in ("model", "phase")}
            arrays["model"] = np.array([code[m] for m in self.model.tolist()], dtype=np.int16)
            arrays["phase"] = (self.phase == str(Phase.DECODE)).astype(np.int8)
            con.executemany(
                "INSERT INTO columns VALUES (?, ?, ?, ?)",
                ((k, v.dtype.str, json.dumps(v.shape), np.ascontiguousarray(v).tobytes()) for k, v in arrays.items()),
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
        path = Path(path)
        if not path.exists():
            raise CoralInputError(f"{path}: no template library here (build one with `coral templates build`)")
        try:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            meta = dict(con.execute("SELECT key, value FROM meta"))
            configs = [n for _, n in con.execute("SELECT idx, name FROM configs ORDER BY idx")]
            raw = con.execute("SELECT name, dtype, shape, data FROM columns").fetchall()
            con.close()
        except sqlite3.DatabaseError as exc:
            raise CoralInputError(f"{path}: not a Coral template library ({exc})") from exc
        if meta.get("format") != str(LIBRARY_FORMAT):
            raise CoralInputError(f"{path}: library format {meta.get('format')!r}, expected {LIBRARY_FORMAT}")
        cols = {n: np.frombuffer(d, dtype=np.dtype(t)).reshape(json.loads(sh)).copy() for n, t, sh, d in raw}
        models = np.array(json.loads(meta["models"]), dtype=object)
        cols["model"] = models[cols["model"]] if len(models) else np.array([], dtype=object)
        cols["phase"] = np.where(cols["phase"] == 1, str(Phase.DECODE), str(Phase.PREFILL)).astype(object)
        return cls(configs=configs, meta=meta, path=path, **cols)


_ROW_COLUMNS = (
    "model", "phase", "slo_ms", "throughput", "counts", "nodes", "node_stage", "node_throughput",
    "stage_layers", "dominated",
)


def dominated_rows(lib: TemplateLibrary) -> np.ndarray:
    """True where a template is never needed: within its (model, phase), a proper sub-multiset of its nodes is a
    template with no less throughput, or an identical node multiset has more (`dominance.undominated`)."""
    out = np.zeros(len(lib), dtype=bool)
    for m, p in lib.keys():
        rows = lib.select(m, p)
        out[rows] = ~undominated(lib.counts[rows], lib.throughput[rows])
    return out


def bottleneck(node_stage: np.ndarray, node_throughput: np.ndarray, stage_layers: np.ndarray) -> np.ndarray:
    """Template throughput: the slowest stage, a stage being the sum of its nodes."""
    width = stage_layers.shape[1]
    stage_thr = np.stack([np.where(node_stage == s, node_throughput, 0.0).sum(axis=1) for s in range(width)], 1)
    return np.where(stage_layers > 0, stage_thr, np.inf).min(axis=1)
