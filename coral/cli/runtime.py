"""`coral serve` (controller + gateway + emulated or local vLLM engines), `coral gateway` (over deployed
engines) and `coral status`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import typer
import uvicorn
from fastapi import FastAPI
from rich.table import Column, Table

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError, load_scenario
from coral.cli.common import DEFAULT_OUT, console, friendly_errors, library_path
from coral.deploy.endpoints import EndpointsFile
from coral.report.dashboard import make_router
from coral.runtime.backends import Backend, EmulatedBackend, VllmProcessBackend
from coral.runtime.controller import Controller, Store, controller_router, runtime_state_provider
from coral.runtime.gateway import GatewayConfig, create_gateway_app, load_secrets
from coral.runtime.registry import Endpoint, InstanceState, Registry
from coral.runtime.server import KEEP_ALIVE_S

if TYPE_CHECKING:
    from coral.runtime.coral_backend import CoralEngineBackend

DEFAULT_URL = "http://127.0.0.1:8080"
API_KEYS_ENV = "CORAL_API_KEYS"
ADMIN_TOKEN_ENV = "CORAL_ADMIN_TOKEN"
KEYS_HELP = f"file of gateway API keys, one a line (also the comma-separated env var {API_KEYS_ENV})"
RATE_HELP = "requests/s allowed per API key (per client address without keys); 0 = unlimited"


def access_config(
    config: GatewayConfig, keys_file: Path | None, rate_limit: float, host: str
) -> GatewayConfig:
    """`config` with the API keys and rate limit; warns (never printing a key) when exposed without keys."""
    keys = load_secrets(API_KEYS_ENV, keys_file)
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] {host} is reachable from other hosts and no API key is set")
    console.print(
        f"gateway API keys: {len(keys) or 'none (open)'}; rate limit per key: {rate_limit or 'none'}"
    )
    return replace(config.with_api_keys(keys), rate_limit_rps=rate_limit)


def allocator_planner(
    scenario_name: str, running: Callable[[], Plan | None], out: Path = DEFAULT_OUT
) -> Callable[[], Plan]:
    """Planner running the allocator on the scenario's template library (built by `coral templates build`),
    warm from the `running` plan so unchanged instances are kept."""
    from coral.templates.library import TemplateLibrary

    try:
        from coral.allocation.allocator import allocate
    except ImportError:
        raise CoralInputError("the allocator is not available in this build; pass --plan PLAN.json") from None
    scenario = load_scenario(scenario_name)
    path = library_path(scenario_name, out)
    if not path.exists():
        raise CoralInputError(
            f"{path}: no template library; run `coral templates build {scenario_name}` first"
        )
    library = TemplateLibrary.load(path)
    return lambda: allocate(library, scenario, running=running())


def static_registry(spec: EndpointsFile) -> Registry:
    """A registry of ready endpoints from an endpoints file (health checks take unreachable ones out)."""
    registry = Registry(classes=spec.request_classes)
    for e in spec.endpoints:
        registry.add(Endpoint(e.id, e.model, e.phase, e.url, e.weight, InstanceState.READY,
                              class_weights=e.class_weights))
    return registry


def build_runtime(
    planner: Callable[[], Plan],
    store: Store,
    backend: Backend,
    interval_s: float,
    config: GatewayConfig | None = None,
    admin_token: str | None = None,
    ready_timeout_s: float = 60.0,
) -> tuple[FastAPI, Controller]:
    """Gateway app with the controller API (`/state`, `/replan`; `admin_token` guards `/replan`) and dashboard
    mounted, and its controller."""
    registry = Registry()
    controller = Controller(store, backend, registry, planner, interval_s=interval_s, ready_timeout_s=ready_timeout_s)
    app = create_gateway_app(registry, config)
    provider = runtime_state_provider(controller, app.state.gateway)
    app.include_router(controller_router(controller, app.state.gateway.state, admin_token))
    app.include_router(make_router(provider))
    return app, controller


def register(app: typer.Typer) -> None:
    """Add `serve` and `status` to `app`."""

    @app.command("serve")
    @friendly_errors
    def serve(
        scenario: str = typer.Argument(..., help="scenario name or file"),
        backend: str = typer.Option(
            "emulated",
            help="emulated | vllm (local `vllm serve` per single-node instance) | coral (the Coral pipeline "
            "engine, one process per node on this machine)",
        ),
        plan: Path | None = typer.Option(
            None, help="serve this plan (re-read every interval) instead of allocating"
        ),
        host: str = typer.Option("127.0.0.1"),
        port: int = typer.Option(8080),
        time_scale: float = typer.Option(1.0, help="multiplies the emulated engines' perf-model delays"),
        interval: float = typer.Option(60.0, help="seconds between allocator runs"),
        db: Path | None = typer.Option(
            None, help="controller state file (default out/<scenario>.runtime.sqlite)"
        ),
        gpus: str = typer.Option("", help="vllm backend: GPU indices to hand out, e.g. '0,1,2,3'"),
        vllm_bin: str = typer.Option("vllm", help="vllm backend: the vllm executable"),
        checkpoint: Path | None = typer.Option(
            None, help="coral backend: Llama checkpoint directory (default: the tiny test model, made once)"
        ),
        api_keys_file: Path | None = typer.Option(None, help=KEYS_HELP),
        admin_token_file: Path | None = typer.Option(
            None, help=f"file holding the token `POST /replan` needs (also the env var {ADMIN_TOKEN_ENV})"
        ),
        rate_limit: float = typer.Option(0.0, help=RATE_HELP),
        ready_timeout: float | None = typer.Option(
            None, help="seconds an engine may take to become healthy (default 60; 600 for vllm and coral, whose "
            "servers take minutes to start on a CPU)"
        ),
    ) -> None:
        """Run controller + gateway + engines; OpenAI API on http://HOST:PORT/v1, state on /state."""
        engines: EmulatedBackend | VllmProcessBackend | CoralEngineBackend
        if backend == "emulated":
            engines = EmulatedBackend(time_scale=time_scale)
        elif backend == "vllm":
            try:
                ids = [int(g) for g in gpus.split(",") if g.strip()]
            except ValueError:
                raise CoralInputError(f"--gpus {gpus!r}: must be comma-separated integers") from None
            engines = VllmProcessBackend(ids, [vllm_bin], log_dir=DEFAULT_OUT / "vllm-logs")
        elif backend == "coral":
            from coral.runtime.coral_backend import CoralEngineBackend

            engines = CoralEngineBackend(checkpoint, log_dir=DEFAULT_OUT / "engine-logs")
        else:
            raise CoralInputError(
                f"--backend {backend!r}: must be 'emulated', 'vllm' or 'coral'; for clusters render manifests with `coral deploy`"
            )
        load_scenario(scenario)
        if plan is not None:
            Plan.load(plan)  # fail now on a bad file
            plan_path = plan
            planner: Callable[[], Plan] = lambda: Plan.load(plan_path)  # noqa: E731
        db_path = db or DEFAULT_OUT / f"{Path(scenario).stem}.runtime.sqlite"
        store = Store(db_path)
        if plan is None:
            planner = allocator_planner(scenario, store.plan)
        cfg = access_config(GatewayConfig(), api_keys_file, rate_limit, host)
        admin = load_secrets(ADMIN_TOKEN_ENV, admin_token_file)
        if len(admin) > 1:
            raise CoralInputError(f"{admin_token_file or ADMIN_TOKEN_ENV}: holds more than one admin token")
        if not admin and host not in ("127.0.0.1", "localhost", "::1"):
            console.print(f"[yellow]warning:[/] POST /replan is open to anyone reaching {host}")
        gw_app, controller = build_runtime(
            planner, store, engines, interval, cfg, admin[0] if admin else None,
            ready_timeout_s=ready_timeout or (60.0 if backend == "emulated" else 600.0),
        )
        controller.start()
        console.print(
            f"[green]coral serve[/] {scenario}: gateway http://{host}:{port}/v1, state /state, db {db_path}"
        )
        try:
            uvicorn.run(gw_app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
        finally:
            controller.stop()
            engines.close()

    @app.command("gateway")
    @friendly_errors
    def gateway(
        endpoints: Path = typer.Option(
            ..., help="endpoints.json written by `coral deploy --target kubernetes`"
        ),
        host: str = typer.Option("127.0.0.1", help="bind address (0.0.0.0 exposes it: set API keys)"),
        port: int = typer.Option(8080),
        max_concurrency: int = typer.Option(256, help="requests upstream at once"),
        max_waiting: int = typer.Option(1024, help="requests queued beyond that before 429"),
        api_keys_file: Path | None = typer.Option(None, help=KEYS_HELP),
        rate_limit: float = typer.Option(0.0, help=RATE_HELP),
    ) -> None:
        """Serve the OpenAI API over deployed engines (static endpoints, no controller)."""
        registry = static_registry(EndpointsFile.load(endpoints))
        cfg = GatewayConfig(max_concurrency=max_concurrency, max_waiting=max_waiting)
        cfg = access_config(cfg, api_keys_file, rate_limit, host)
        console.print(
            f"[green]coral gateway[/]: {len(registry.all())} endpoint(s) on http://{host}:{port}/v1"
        )
        uvicorn.run(
            create_gateway_app(registry, cfg),
            host=host,
            port=port,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
        )

    @app.command("status")
    @friendly_errors
    def status(url: str = typer.Option(DEFAULT_URL, help="base URL of `coral serve`")) -> None:
        """Show the controller's plan, instances and recent actions."""
        try:
            st = httpx.get(f"{url.rstrip('/')}/state", timeout=5).json()
        except httpx.HTTPError as exc:
            raise CoralInputError(
                f"--url {url}: cannot reach the controller ({type(exc).__name__})"
            ) from None
        p = st.get("plan")
        if p:
            n = len(p["instances"])
            console.print(
                f"plan [bold]{p['scenario']}[/] ({p['method']}): {n} instances, ${p['cost_per_hour']:.2f}/h"
            )
        t = Table(
            Column("instance", no_wrap=True),
            "state",
            "in flight",
            "served",
            "plan/obs",
            title="instances",
        )
        for i in st["instances"]:
            state = i["state"] if i["healthy"] or i["state"] != "ready" else "ready (unhealthy)"
            share = f"{i['target_share']:.2f}/{i['observed_share']:.2f}"
            t.add_row(i["id"], state, str(i["inflight"]), str(i["served"]), share)
        console.print(t)
        a = Table(
            "seq", "action", Column("instance", no_wrap=True), "status", "detail", title="recent actions"
        )
        for row in st["actions"][:10]:
            a.add_row(str(row["seq"]), row["kind"], row["instance_id"], row["status"], row["detail"])
        console.print(a)
        if st.get("last_error"):
            console.print(f"[red]last controller error:[/] {st['last_error']}")
