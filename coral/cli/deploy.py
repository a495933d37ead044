"""`coral deploy`: write SkyPilot, Kubernetes or per-node vLLM launch files for a plan."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from coral.catalog.loader import CoralInputError
from coral.cli.common import DEFAULT_OUT, console, friendly_errors

if TYPE_CHECKING:
    from coral.allocation.plan import Plan

TARGET_HELP = ("deploy target the plan is made for: skypilot | kubernetes | commands (implies --engine vllm; only "
               "templates that `coral deploy --target` launches)")

NEXT_STEP = {
    "skypilot": "for f in {out}/*.sky.yaml; do sky serve up -y -n \"$(basename \"$f\" .sky.yaml)\" \"$f\" "
                "--secret HF_TOKEN; done",
    "kubernetes": "kubectl create secret generic hf-token --from-literal=token=\"$HF_TOKEN\"; kubectl apply -f {out}",
    "commands": "run each {out}/*.sh on its node (pipelines: set CORAL_HEAD_ADDR to the rank-0 node's address)",
}


def plan_file_name(scenario: str, mode: str, method: str, engine: str, target: str | None) -> str:
    """The name `coral allocate` gives its plan: `<scenario>.<mode>.<method>[.<engine> | .<target>].plan.json`."""
    tag = f".{target}" if target else ("" if engine == "coral" else f".{engine}")
    return f"{Path(scenario).stem}.{mode}.{method}{tag}.plan.json"


def replan_command(plan: Plan, target: str) -> str:
    """The command that makes a plan like `plan` (same scenario, mode and planning method) that `target`
    launches, and the file it writes."""
    if plan.slo is not None:  # searched with the simulator in the loop: `coral run`
        return (f"`coral run {plan.scenario} --target {target}` (writes "
                f"{DEFAULT_OUT}/run-{plan.scenario}/plan.{plan.mode}.{plan.method}.json)")
    from coral.experiments.allocation import METHODS

    method = plan.method if plan.method in METHODS else "coral"  # a hand-made plan: Coral's allocator
    flags = ([f"--mode {plan.mode}"] if plan.mode != "cost" else []) + (
        [f"--method {method}"] if method != "coral" else [])
    name = plan_file_name(plan.scenario, plan.mode, method, "vllm", target)
    return f"`{' '.join(['coral allocate', plan.scenario, *flags, '--target', target])}` (writes {DEFAULT_OUT}/{name})"


def replan_advice(plan: Plan, target: str) -> str:
    """What to do about a plan `target` cannot fully launch."""
    how = replan_command(plan, target)
    if plan.target == target:
        return (f"The plan records --target {target}, so it was changed after planning (a plan made for a target "
                f"holds only what it launches): make it again with {how}.")
    return f"Plan for this target: {how} plans only what {target} launches (or serve this plan with `coral serve`)."


def register(app: typer.Typer) -> None:
    """Add `deploy` to `app`."""

    @app.command("deploy")
    @friendly_errors
    def deploy(
        plan: Path = typer.Option(..., "--plan", help="plan JSON written by `coral allocate` or `coral run`"),
        target: str = typer.Option(..., "--target", help="skypilot | kubernetes | commands"),
        out: Path = typer.Option(..., "--out", help="directory for the manifests"),
        image: str | None = typer.Option(None, help="vLLM container image (kubernetes, skypilot; default: the "
                                          "release `coral.deploy.render.VLLM_IMAGE` names)"),
        strict: bool = typer.Option(False, help="also fail when only some instances of a model cannot be rendered"),
    ) -> None:
        """Render stock-vLLM deployment manifests for every instance of a plan.

        Fails, writing nothing, when a (model, phase) of the plan would be left with no launchable instance.
        A plan made with `--target` for this target is always launched whole."""
        from rich.table import Table

        from coral.allocation.plan import Plan
        from coral.catalog.loader import builtin_catalog
        from coral.deploy.render import (
            TARGETS,
            VLLM_IMAGE,
            check_plan,
            render,
            skipped_instances,
            uncovered_keys,
        )

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
            raise CoralInputError(f"--plan: {names} would get no launchable instance on {target}, so nothing was "
                                  f"written. {replan_advice(p, target)}")
        if skipped:
            lost: dict[str, float] = defaultdict(float)
            for inst in p.instances:
                if inst.id in skipped:
                    lost[f"{inst.model}/{inst.phase}"] += inst.throughput
            detail = ", ".join(f"{k} loses {v:,.0f} tok/s" for k, v in lost.items())
            if strict:
                raise CoralInputError(f"--strict: {len(skipped)} instance(s) cannot be rendered ({detail}). "
                                      f"{replan_advice(p, target)}")
            console.print(f"[yellow]warning[/]: planned capacity is reduced: {detail}. {replan_advice(p, target)}")
        res = render(p, target, out, catalog, image=image or VLLM_IMAGE)
        console.print(f"[green]wrote[/] {len(res.files)} file(s) to {out} (index.json lists them)")
        console.print(f"next: {NEXT_STEP[target].format(out=out)}")
