"""`coral deploy`: write SkyPilot, Kubernetes (KubeRay) or per-node vLLM launch files for a plan."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError
from coral.cli.common import console, friendly_errors
from coral.deploy.render import TARGETS, VLLM_IMAGE, render


def register(app: typer.Typer) -> None:
    """Add `deploy` to `app`."""

    @app.command("deploy")
    @friendly_errors
    def deploy(
        plan: Path = typer.Option(..., "--plan", help="plan JSON written by `coral allocate`"),
        target: str = typer.Option(..., "--target", help="skypilot | kubernetes | commands"),
        out: Path = typer.Option(..., "--out", help="directory for the manifests"),
        image: str = typer.Option(VLLM_IMAGE, help="container image (kubernetes)"),
        strict: bool = typer.Option(False, help="fail when an instance cannot be rendered"),
    ) -> None:
        """Render deployment manifests for every instance of a plan."""
        if target not in TARGETS:
            raise CoralInputError(f"--target: must be one of {', '.join(TARGETS)}, not {target!r}")
        res = render(Plan.load(plan), target, out, image=image)
        console.print(f"[green]wrote[/] {len(res.files)} file(s) to {out} (index.json lists them)")
        if res.skipped:
            t = Table("instance", "reason", title=f"{len(res.skipped)} instance(s) skipped")
            for iid, why in res.skipped.items():
                t.add_row(iid, why)
            console.print(t)
            if strict:
                raise CoralInputError(f"{len(res.skipped)} instance(s) cannot be rendered for {target}")
