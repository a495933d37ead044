"""The rich Console of the benchmarks' tables: the rule of coral's CLI (coral.cli.common), so that a table piped to
a file or `tee` is not cut to 80 columns.

Imported by the scripts beside it as `from _console import table_console` (a script's folder is on sys.path).
`stamped` adds to a benchmark's JSON where and when it was measured (`run_stamp`), which the results pages show."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from coral.cli.common import PIPE_WIDTH, console_width


def table_console(stderr: bool = False, pipe_width: int = PIPE_WIDTH) -> Console:
    """A Console as wide as the terminal (or COLUMNS) when there is one, else `pipe_width` columns."""
    return Console(stderr=stderr, width=None if console_width() is None else pipe_width)


def run_stamp() -> dict[str, Any]:
    """Where and when a benchmark's figures were measured, written beside them in its JSON (key `meta`) and shown
    by benchmarks/render_results.py: the commit (and whether the working tree had changes), the UTC date, the
    machine (host, CPU, cores, memory, GPUs), the load average when the figures were written, and the command."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                   if line.startswith("MemTotal:")), 0)
    gpus = ""
    if shutil.which("nvidia-smi"):
        try:
            gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=10).stdout.strip().replace("\n", ", ")
        except (OSError, subprocess.SubprocessError):
            gpus = ""
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(mem_kb / 2**20, 1),
                    "gpus": gpus or None, "python": platform.python_version()},
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def stamped(data: Any) -> dict[str, Any]:
    """`data` (a benchmark's JSON document; a list becomes `{"rows": data}`) with `meta`: `run_stamp()`."""
    doc = dict(data) if isinstance(data, dict) else {"rows": data}
    return {"meta": run_stamp(), **doc}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def stamped_json(data: Any, **kwargs: Any) -> str:
    """`json.dumps` of `stamped(data)`: a benchmark's JSON with where and when it was measured."""
    return json.dumps(stamped(data), **kwargs)
