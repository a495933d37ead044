"""Test tiers: one line per tier after collection saying whether it runs, was not selected, or cannot run here.

The default run (`python -m pytest`, pyproject's `addopts`) is the fast tier: everything not marked `slow`,
`vllm`, `browser` or `cluster`. `-m slow`, `-m vllm`, `-m browser`, `-m cluster` select a tier; `-m ""` runs them
all (`.ci/run`). A tier that does not run here, not selected or missing its tool, is named with the command that
installs what it needs.

Also the engine tests' shared checkpoint: `ckpt`, a tiny 4-layer Llama with sharp logits (one per module), and
`whole`, the whole model on it (a module that needs another checkpoint defines its own `ckpt`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sky_check import INSTALL_HINT, sky_python

if TYPE_CHECKING:
    from coral.engine.reference import WholeModel


@dataclass(frozen=True)
class Tier:
    marker: str
    needs: str  # what the tier needs beyond this Python ('' for nothing)
    install: str  # the command that installs it
    found: Callable[[], str | None]  # what runs the tier here, or None when missing


def _vllm() -> str | None:
    from coral import vllm_cpu

    python = vllm_cpu.vllm_python()
    version = vllm_cpu.installed_version(python)
    return None if version is None else f"vllm {version} ({python})"


def _ray() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return f"ray {ray.__version__} (a multi-node cluster of raylets on this machine)"


def _chromium() -> str | None:
    from coral.report.browser import chromium_binary

    return chromium_binary()


TIERS = (
    Tier("slow", "", "", lambda: "this Python"),
    Tier("vllm", "vLLM's CPU build", "python -m coral.vllm_cpu (~8 min, 3.5 GB)", _vllm),
    Tier("browser", "chromium", "bash .ci/install-browser", _chromium),
    Tier("cluster", "ray", 'pip install -e ".[ray,engine]"', _ray),
)
SKY_CHECK_TEST = "test_skypilot_services_pass_sky_serve_up_checks"


def status(selected: int, found: str | None, needs: str, install: str, select: str) -> str:
    """How a tier of `selected` tests fares here: runs with `found`; not selected (`select` selects it); or skipped,
    `needs` not found. A tier that does not run says the command that installs what it needs."""
    if not selected:
        return f"not selected ({select}{f'; needs {needs}: {install}' if needs else ''})"
    if found is None:
        return f"skipped, {needs} not found — install it: {install}"
    return f"runs {selected} test(s) with {found}"


def pytest_report_collectionfinish(config: pytest.Config, start_path: Path, items: list[pytest.Item]) -> list[str]:
    """One line per tier: runs / not selected / skipped and how to install what it needs."""
    marked = {t.marker: [i for i in items if i.get_closest_marker(t.marker)] for t in TIERS}
    fast = sum(1 for i in items if not any(i.get_closest_marker(t.marker) for t in TIERS))
    lines = [f"fast tier: {status(fast, 'this Python', '', '', 'the default run')}"]
    for t in TIERS:
        n = len(marked[t.marker])
        lines.append(f"{t.marker} tier: {status(n, t.found() if n else None, t.needs, t.install, f'pytest -m {t.marker}')}")
    sky = sum(1 for i in items if i.name.startswith(SKY_CHECK_TEST))
    if sky:
        lines.append(f"skypilot check: {status(sky, sky_python(), 'SkyPilot', INSTALL_HINT, '')}")
    return lines


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from coral.tiny_model import TinyLlamaSpec, make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny",
                           TinyLlamaSpec(num_hidden_layers=4, initializer_range=0.25))


@pytest.fixture(scope="module")
def whole(ckpt: Path) -> WholeModel:
    from coral.engine.reference import WholeModel

    return WholeModel(ckpt)
