"""`coral deploy`: write SkyPilot, Kubernetes (KubeRay for the Coral engine) or per-node launch files for a plan,
for stock vLLM or the Coral engine, with the gateway in front of them as the single client endpoint."""

from __future__ import annotations

import shlex
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer

from coral.catalog.loader import CoralInputError
from coral.cli.common import (
    DEFAULT_OUT,
    check_out_folder,
    console,
    err_console,
    friendly_errors,
    plan_or_current,
)

if TYPE_CHECKING:
    from coral.allocation.plan import Plan
    from coral.deploy.common import RenderResult
    from coral.deploy.render import Target

TARGET_HELP = ("deploy target the plan is made for: skypilot | kubernetes | commands (implies --engine vllm; only "
               "templates that `coral deploy --target` launches)")

KEYS_SECRET = "kubectl create secret generic {secret} --from-literal={keys_key}=\"${keys_env}\""
ADMIN_SECRET = " --from-literal={admin_key}=\"${admin_env}\""
KEYS_NOTE = " ({keys_env}: the API keys clients may use, comma-separated, 8+ characters each)"
KUBECTL_APPLY = "for f in {out}/*.k8s.yaml; do kubectl apply -f \"$f\"; done"
SKY_UP = "cd {out} && for f in *.sky.yaml; do sky serve up -y -n \"$(basename \"$f\" .sky.yaml)\" \"$f\"%s; done"
SKY_GATEWAY = ["bash {out}/{fill} (once every engine service is up: writes {endpoints} from `sky serve status "
               "--endpoint NAME`)", "cd {out} && sky serve up -y -n {gateway} {gateway_file} --secret {keys_env}"]
COMMANDS_GATEWAY = ("on the gateway's machine: {keys_env}=KEYS CORAL_ADDR_<ENGINE>=ADDRESS ... bash {out}/{script} "
                    "(one address per engine: index.json's endpoints.engines)")
PORT_FORWARD = ("in the cluster; from elsewhere `kubectl port-forward service/{gateway} {port}:{port}`, then "
                "http://127.0.0.1:{port}/v1")
NEXT_STEPS: dict[tuple[str, str], list[str]] = {
    ("vllm", "kubernetes"): ["kubectl create secret generic hf-token --from-literal=token=\"$HF_TOKEN\"",
                             KEYS_SECRET + KEYS_NOTE, KUBECTL_APPLY],
    ("vllm", "skypilot"): [SKY_UP % " --secret HF_TOKEN", *SKY_GATEWAY],
    ("vllm", "commands"): ["run each {out}/*.replica<k>.sh and *.rank<r>.sh on its node (pipelines: set "
                           "CORAL_HEAD_ADDR to the rank-0 node's address)", COMMANDS_GATEWAY],
    ("coral", "kuberay"): [KEYS_SECRET + ADMIN_SECRET + KEYS_NOTE, KUBECTL_APPLY + " (needs the KubeRay operator)"],
    ("coral", "kubernetes"): [KEYS_SECRET + KEYS_NOTE, KUBECTL_APPLY],
    ("coral", "skypilot"): [SKY_UP % "", *SKY_GATEWAY],
    ("coral", "commands"): ["copy {out} to every machine; per instance run its .scheduler.sh, then each .node<r>.sh on "
                            "a machine of its config (set CORAL_HEAD_ADDR to node 0's address and CORAL_SCHEDULER_ADDR "
                            "to the scheduler's)", COMMANDS_GATEWAY],
}
"""What to run after `coral deploy --engine E --target T`, in order (`next_steps` then names the URL clients use)."""


def next_steps(engine: str, target: str, out: Path, res: RenderResult) -> list[str]:
    """The `next:` lines for the files `res` wrote to `out`: what to run, in order, ending at the gateway's URL."""
    from coral.deploy import gateway

    gw = res.gateways[0]
    fields = {"out": shlex.quote(str(out)), "secret": gateway.GATEWAY_SECRET,
              "keys_key": gateway.SECRET_KEYS[gateway.API_KEYS_ENV], "keys_env": gateway.API_KEYS_ENV,
              "admin_key": gateway.SECRET_KEYS[gateway.ADMIN_TOKEN_ENV], "admin_env": gateway.ADMIN_TOKEN_ENV,
              "fill": gateway.SKY_FILL_SCRIPT, "endpoints": gateway.ENDPOINTS_FILE, "script": gateway.COMMANDS_SCRIPT,
              "gateway": gw.name, "gateway_file": gw.files[0], "port": gateway.GATEWAY_PORT}
    steps = [step.format(**fields) for step in NEXT_STEPS[(engine, target)]]
    urls = [f"{g.url} ({PORT_FORWARD.format(**{**fields, 'gateway': g.name})})" if target in ("kubernetes", "kuberay")
            else g.url for g in res.gateways]
    which = "" if len(urls) == 1 else "the gateway of their region's RayCluster, "
    return [*steps, f"clients use {which}{' or '.join(urls)}, sending `Authorization: Bearer KEY` (KEY: one of "
                    f"{gateway.API_KEYS_ENV})"]


CORAL_ADVICE = ("The Coral engine launches every instance on --target kuberay or kubernetes (one pod per node, "
                "each pinned to its node config).")


def plan_file_name(scenario: str, mode: str, method: str, engine: str, target: str | None) -> str:
    """The name `coral allocate` gives its plan: `<scenario>.<mode>.<method>[.<engine> | .<target>].plan.json`."""
    tag = f".{target}" if target else ("" if engine == "coral" else f".{engine}")
    return f"{Path(scenario).stem}.{mode}.{method}{tag}.plan.json"


def replan_command(plan: Plan, target: str) -> str:
    """The command that makes a plan like `plan` (same scenario, mode and planning method) that `target`
    launches, and the file it writes."""
    scenario = shlex.quote(plan.scenario)  # the plan's own text: shown as one shell word, for copying
    if plan.slo is not None:  # searched with the simulator in the loop: `coral run`
        return (f"`coral run {scenario} --target {target}` (writes "
                f"{DEFAULT_OUT}/run-{plan.scenario}/plan.{plan.mode}.{plan.method}.json)")
    from coral.experiments.allocation import METHODS

    method = plan.method if plan.method in METHODS else "coral"  # a hand-made plan: Coral's allocator
    flags = ([f"--mode {plan.mode}"] if plan.mode != "cost" else []) + (
        [f"--method {method}"] if method != "coral" else [])
    name = plan_file_name(plan.scenario, plan.mode, method, "vllm", target)
    return f"`{' '.join(['coral allocate', scenario, *flags, '--target', target])}` (writes {DEFAULT_OUT}/{name})"


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
        plan: Path | None = typer.Option(None, "--plan", help="plan JSON written by `coral allocate` or `coral run` "
                                         "(default: the scenario's current plan, the one `coral run` chose)"),
        scenario: str = typer.Option("core", help="without --plan: the scenario whose current plan to deploy"),
        target: str = typer.Option(..., "--target", help="vllm: skypilot | kubernetes | commands; coral: kuberay | "
                                   "kubernetes | skypilot | commands"),
        out: Path = typer.Option(..., "--out", help="directory for the manifests"),
        engine: str | None = typer.Option(None, "--engine", help="vllm (stock vLLM) | coral (the Coral engine: "
                                          "every instance, heterogeneous pipelines included) (default: the engine "
                                          "the plan was made for: coral for `coral run` and `coral allocate` plans, "
                                          "vllm for those made with --engine vllm or --target)"),
        checkpoint: str | None = typer.Option(None, help="--engine coral: the checkpoint directory as every node "
                                              "sees it (absolute path, in the image or on a mounted volume)"),
        image: str | None = typer.Option(None, help="container image (kubernetes, kuberay, skypilot; default: "
                                          "`coral.deploy.render.VLLM_IMAGE`, or `coral.deploy.coral_engine."
                                          "CORAL_IMAGE` with --engine coral: coral with the ray and engine extras "
                                          "and a CUDA torch)"),
        gateway_image: str | None = typer.Option(None, help="container image of the gateway, `coral gateway` (kubernetes, "
                                                 "skypilot; default: --image with --engine coral, else "
                                                 "`coral.deploy.coral_engine.CORAL_IMAGE`)"),
        strict: bool = typer.Option(True, help="fail, writing nothing, when some instances cannot be rendered "
                                    "(--no-strict: deploy the rest, with a warning naming the capacity lost)"),
    ) -> None:
        """Render deployment manifests for every instance of a plan, stock vLLM or the Coral engine, and the gateway
        in front of them: the single endpoint clients use.

        Fails, writing nothing, when a (model, phase) of the plan would be left with no launchable instance, and
        (unless --no-strict) when any instance would be. A plan made with `--target` for this target is always
        launched whole."""
        from rich.markup import escape
        from rich.table import Table

        from coral.allocation.plan import Plan
        from coral.catalog.loader import builtin_catalog
        from coral.deploy import coral_engine
        from coral.deploy.render import (
            TARGETS,
            check_plan,
            render,
            skipped_instances,
            uncovered_keys,
        )

        if engine is not None and engine not in ("vllm", "coral"):
            raise CoralInputError(f"--engine: must be vllm or coral, not {engine!r}")
        check_out_folder(out)
        plan = plan_or_current(plan, scenario)
        try:
            p = Plan.load(plan)
        except CoralInputError as exc:
            raise CoralInputError(f"{exc}\nnothing was written") from exc
        if engine is None:
            engine = p.engine
            err_console.print(f"engine: {'the Coral engine' if engine == 'coral' else 'stock vLLM'}, the one the plan "
                              f"was made for (--engine {'vllm' if engine == 'coral' else 'coral'} for the other)")
        if engine == "coral":
            coral_engine.check_target(target, checkpoint)
        elif target not in TARGETS:
            raise CoralInputError(f"--target: must be one of {', '.join(TARGETS)}, not {target!r}"
                                  + (" (kuberay: --engine coral)" if target == "kuberay" else ""))
        elif checkpoint is not None:
            raise CoralInputError("--checkpoint: only with --engine coral (stock vLLM loads the model by name)")
        if gateway_image is not None and target not in ("kubernetes", "skypilot"):
            raise CoralInputError(f"--gateway-image: only with --target kubernetes or skypilot (on {target} the "
                                  "gateway runs " + ("on the Ray head, in --image)" if target == "kuberay" else
                                                     "where gateway.sh is run, with coral installed there)"))
        catalog = builtin_catalog()
        check_plan(p, catalog, f"--plan {plan}")
        who = "the Coral engine" if engine == "coral" else "stock vLLM"
        skipped = (coral_engine.skipped_instances(p, target) if engine == "coral"
                   else skipped_instances(p, cast("Target", target), catalog))
        if skipped:
            t = Table("instance", "reason", title=f"{len(skipped)} instance(s) {who} cannot launch on {target}")
            for iid, why in skipped.items():
                t.add_row(iid, why)
            console.print(t)
        uncovered = uncovered_keys(p, skipped)

        def advice() -> str:
            return CORAL_ADVICE if engine == "coral" else replan_advice(p, target)

        if uncovered:
            names = ", ".join(f"{m}/{ph}" for m, ph in uncovered)
            raise CoralInputError(f"--plan: {names} would get no launchable instance on {target}, so nothing was "
                                  f"written. {advice()}")
        if skipped:
            lost: dict[str, float] = defaultdict(float)
            for inst in p.instances:
                if inst.id in skipped:
                    lost[f"{inst.model}/{inst.phase}"] += inst.throughput
            detail = ", ".join(f"{k} loses {v:,.0f} tok/s" for k, v in lost.items())
            if strict:
                raise CoralInputError(f"--strict (the default): {len(skipped)} instance(s) cannot be rendered ({detail}), so nothing "
                                      f"was written (--no-strict deploys the rest). {advice()}")
            console.print(f"[yellow]warning[/]: {escape(f'planned capacity is reduced: {detail}. {advice()}')}")
        res = render(p, target, out, catalog, image=image, engine=engine, checkpoint=checkpoint,
                     gateway_image=gateway_image)
        console.print(f"[green]wrote[/] {len(res.files)} file(s) to {escape(str(out))} (index.json lists them)")
        for step in next_steps(engine, target, out, res):
            console.print(f"next: {escape(step)}")
