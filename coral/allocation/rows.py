"""Which rows of a template library a (model, phase) may use: positive throughput, single-config for the
homogeneous baselines, and the undominated ones among them (memoised per library: none depends on demand,
prices or availability)."""

from __future__ import annotations

import numpy as np

from coral.templates.dominance import undominated
from coral.templates.library import TemplateLibrary


def key_rows(library: TemplateLibrary, model: str, phase: str, homogeneous: bool) -> tuple[np.ndarray, np.ndarray]:
    """(usable rows, undominated rows) of one (model, phase): positive throughput, single-config when
    `homogeneous` (the sub-multisets of a single-config template are single-config, so the library's dominance
    flags hold among them too). Memoised per library object: neither depends on demand, prices or availability."""
    def make() -> tuple[np.ndarray, np.ndarray]:
        rows = library.select(model, phase)
        rows = rows[library.throughput[rows] > 0]
        if homogeneous:
            rows = rows[(library.counts[rows] > 0).sum(axis=1) == 1]
        return rows, rows[~library.dominated[rows]]

    return library.memo(("key_rows", model, phase, homogeneous), make)


def restricted_rows(library: TemplateLibrary, usable: np.ndarray, kept: np.ndarray, allowed: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(usable, undominated) rows of one key restricted to `allowed` template ids; the undominated set is
    recomputed among them when the restriction removed some (a template dominated only by a removed one is
    undominated again). Memoised per library object and row sets (a re-plan asks for the same ones)."""
    ok = np.isin(usable, allowed)
    if ok.all():
        return usable, kept
    rows = usable[ok]
    return library.memo(("restricted_rows", rows.tobytes()), lambda: (
        rows, np.sort(rows[undominated(library.counts[rows], library.throughput[rows])])))
