"""Headless Chromium (Debian's `chromium`) for screenshots and rendered-DOM dumps of the report pages."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from coral.catalog.loader import CoralInputError

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium_binary() -> str | None:
    """Path of the chromium executable, or None when it is not installed (see .ci/install-browser)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(
    url: str,
    *,
    screenshot: str | Path | None = None,
    dump_dom: bool = False,
    window: tuple[int, int] = (1400, 2000),
    virtual_time_ms: int | None = None,
    timeout_s: float = 120.0,
) -> str:
    """Load `url` headless; write a PNG to `screenshot` and/or return the rendered DOM (else '')."""
    binary = chromium_binary()
    if binary is None:
        raise CoralInputError("chromium is not installed (Debian: apt-get install chromium)")
    if (screenshot is None) == (not dump_dom):
        raise ValueError("pass exactly one of screenshot= or dump_dom=True")
    with tempfile.TemporaryDirectory(prefix="coral-chromium-") as profile:
        args = [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
        ]
        if virtual_time_ms is not None:
            args.append(f"--virtual-time-budget={virtual_time_ms}")
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            shot.parent.mkdir(parents=True, exist_ok=True)
            args.append(f"--screenshot={shot}")
        else:
            args.append("--dump-dom")
        done = subprocess.run([*args, url], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or (screenshot is not None and not Path(screenshot).exists()):
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"chromium failed on {url} (exit {done.returncode}):\n{tail}")
    return done.stdout if dump_dom else ""
