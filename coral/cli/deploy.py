"""`coral deploy`: write SkyPilot, Kubernetes or per-node vLLM launch files for a plan."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import typer
from rich.table import Table

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.cli.common import console, friendly_errors
from coral.deploy.render import TARGETS, VLLM_IMAGE, check_plan, render, skipped_instances, uncovered_keys


def register(app: typer.Typer) -> None:
    """Add `deploy` to `app`."""

    @app.command("deploy")
    @friendly_errors
    def deploy(
        plan: Path = typer.Option(..., "--plan", help="plan JSON written by `coral allocate`"),
        target: str = typer.Option(..., "--target", help="skypilot | kubernetes | commands"),
        out: Path = typer.Option(..., "--out", help="directory for the manifests"),
        image: str = typer.Option(VLLM_IMAGE, help="vLLM container image (kubernetes, skypilot)"),
        strict: bool = typer.Option(False, help="also fail when only some instances of a model cannot be rendered"),
    ) -> None:
        """Render stock-vLLM deployment manifests for every instance of a plan.

        Fails, writing nothing, when a (model, phase) of the plan would be left with no launchable instance."""
        if target not in TARGETS:
            raise CoralInputError(f"--target: must be one of {', '.join(TARGETS)}, not {target!r}")
        p = Plan.load(plan)
        catalog = builtin_catalog()
        check_plan(p, catalog, f"--plan {plan}")
        skipped = skipped_instances(p, target, catalog)
        if skipped:
            t = Table("instance", "reason", title=f"{len(skipped)} instance(s) stock vLLM cannot launch on {target}")
            for iid, why in skipped.items():
                t.add_row(iid, why)
            console.print(t)
        uncovered = uncovered_keys(p, skipped)
        if uncovered:
            names = ", ".join(f"{m}/{ph}" for m, ph in uncovered)
            raise CoralInputError(
                f"--plan: {names} would get no launchable instance, so nothing was written. Re-plan for the engine "
                f"you deploy: `coral allocate {p.scenario} --engine vllm` plans only what stock vLLM launches "
                "(or serve this plan with the Coral engine)."
            )
        if skipped:
            lost: dict[str, float] = defaultdict(float)
            for inst in p.instances:
                if inst.id in skipped:
                    lost[f"{inst.model}/{inst.phase}"] += inst.throughput
            detail = ", ".join(f"{k} loses {v:,.0f} tok/s" for k, v in lost.items())
            if strict:
                raise CoralInputError(f"--strict: {len(skipped)} instance(s) cannot be rendered ({detail})")
            console.print(f"[yellow]warning[/]: planned capacity is reduced: {detail}")
        res = render(p, target, out, catalog, image=image)
        console.print(f"[green]wrote[/] {len(res.files)} file(s) to {out} (index.json lists them)")
