"""Check SkyPilot service YAMLs as `sky serve up` does, with a Python that has SkyPilot:

    python tests/sky_check.py FILE.sky.yaml ...

Each file is loaded with `sky.Task.from_yaml` and checked by `sky.serve.validate_service_task(task, pool=False)`,
the service checks `sky serve up` runs before it launches anything (ports, readiness probe, replicas, spot
settings). Resource checks against SkyPilot's cloud catalogs are not run: they download the catalogs.

SkyPilot pins older uvicorn and click than Coral, so it lives in a venv of its own (`bash .ci/install-skypilot`,
`~/.cache/coral/skypilot-<version>`, or $CORAL_SKY_PYTHON); imported, this module only finds that Python.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SKYPILOT_VERSION = "0.14.1"
PYTHON_ENV_VAR = "CORAL_SKY_PYTHON"
INSTALL_HINT = "bash .ci/install-skypilot"


def default_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coral"
    return cache / f"skypilot-{SKYPILOT_VERSION}"


def sky_python() -> str | None:
    """A Python that imports SkyPilot: $CORAL_SKY_PYTHON, this one, or the default venv's; None without one."""
    if os.environ.get(PYTHON_ENV_VAR):
        return os.environ[PYTHON_ENV_VAR]
    if importlib.util.find_spec("sky") is not None:
        return sys.executable
    python = default_venv() / "bin" / "python"
    return str(python) if python.exists() else None


def check(paths: list[str]) -> list[str]:
    """'path: problem' for each file `sky serve up` would refuse."""
    import sky
    from sky.serve import validate_service_task

    problems = []
    for path in paths:
        try:
            task = sky.Task.from_yaml(path)
            validate_service_task(task, pool=False)
        except Exception as exc:  # SkyPilot raises ValueError, RuntimeError and schema errors alike
            problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return problems


if __name__ == "__main__":
    found = check(sys.argv[1:])
    print("\n".join(found) or f"{len(sys.argv) - 1} service file(s) pass sky serve up's checks")
    sys.exit(1 if found else 0)
