"""Which templates each engine can run: every template on the Coral engine; on stock vLLM (disaggregated
prefill/decode), single-node templates and prefill pipelines of one node per stage with one TP degree, whose TP
degrees divide the model's attention heads (no decode pipeline under NixlConnector). The per-instance rule the
deploy stage checks plans with is `coral.deploy.vllm.realisable`; this is the same rule over a library's
columns, so that a plan is made only from templates its engine launches."""

from __future__ import annotations

import numpy as np

from coral.catalog.loader import Catalog, CoralInputError
from coral.catalog.schema import parse_config_name
from coral.templates.library import TemplateLibrary, dominated_rows

ENGINES = ("coral", "vllm")


def engine_library(library: TemplateLibrary, engine: str, catalog: Catalog) -> TemplateLibrary:
    """The templates `engine` can run: all of them for the Coral engine, the ones stock vLLM launches in a
    disaggregated deployment for `vllm` (`realisable`, vectorised over the library's columns; dominance
    flags recomputed within what is left)."""
    if engine not in ENGINES:
        raise CoralInputError(f"--engine: must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "coral" or not len(library):
        return library
    used = library.nodes >= 0
    tp_of = np.array([parse_config_name(c)[1] for c in library.configs])
    tp = np.where(used, tp_of[np.maximum(library.nodes, 0)], 0)
    heads = np.array([catalog.model(str(m)).num_attention_heads for m in library.model])
    heads_ok = ((heads[:, None] % np.maximum(tp, 1) == 0) | ~used).all(axis=1)
    n_stages = library.n_stages
    one_node_per_stage = used.sum(axis=1) == n_stages
    one_tp = tp.max(axis=1) == np.where(used, tp, tp.max() + 1).min(axis=1)
    pipeline_ok = one_node_per_stage & one_tp & (library.phase != "decode")
    keep = heads_ok & ((n_stages == 1) | pipeline_ok)
    sub = library.subset(np.flatnonzero(keep))
    sub.dominated = dominated_rows(sub)
    return sub
