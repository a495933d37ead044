"""`coral serve` (controller + gateway + emulated or local vLLM engines), `coral gateway` (over deployed
engines) and `coral status`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Column, Table

from coral.catalog.loader import CoralInputError, load_scenario
from coral.cli.common import (
    DEFAULT_OUT,
    JSON_HELP,
    console,
    current_plan_path,
    err_console,
    friendly_errors,
    library_path,
    print_json,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from coral.allocation.plan import Plan
    from coral.allocation.plan_check import PlanLimits
    from coral.allocation.shedding import Shedder
    from coral.catalog.loader import Catalog
    from coral.catalog.schema import Scenario
    from coral.deploy.endpoints import EndpointsFile
    from coral.runtime.backends import Backend, EmulatedBackend, VllmProcessBackend
    from coral.runtime.controller import Controller, Store
    from coral.runtime.coral_backend import CoralEngineBackend
    from coral.runtime.gateway import GatewayConfig
    from coral.runtime.gateway.config import ShedMode
    from coral.runtime.market import MarketWatcher
    from coral.runtime.registry import Registry
    from coral.simulation.engine import ObservedDemand

DEFAULT_URL = "http://127.0.0.1:8080"
API_KEYS_ENV = "CORAL_API_KEYS"
ADMIN_TOKEN_ENV = "CORAL_ADMIN_TOKEN"
READ_TOKENS_ENV = "CORAL_READ_TOKENS"
KEYS_HELP = f"file of gateway API keys, one a line (also the comma-separated env var {API_KEYS_ENV})"
READ_HELP = (
    f"file of read-only tokens for /dashboard, /metrics and /state, one a line (also the env var {READ_TOKENS_ENV})"
)
RATE_HELP = "requests/s allowed per API key (per client address without keys); 0 = unlimited"
GRACE_HELP = "seconds a shutdown (SIGTERM, Ctrl-C) waits for requests in flight; a second signal exits at once"


def access_config(
    config: GatewayConfig,
    keys_file: Path | None,
    rate_limit: float,
    host: str,
    read_tokens_file: Path | None = None,
    admin_token: str | None = None,
) -> GatewayConfig:
    """`config` with the API keys, read-only and admin tokens and rate limit; warns (never printing a key) when
    exposed without keys."""
    from coral.runtime.gateway import load_secrets

    keys = load_secrets(API_KEYS_ENV, keys_file)
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] {host} is reachable from other hosts and no API key is set")
    read = load_secrets(READ_TOKENS_ENV, read_tokens_file)
    console.print(
        f"gateway API keys: {len(keys) or 'none (open)'}; read-only tokens: {len(read) or 'none'}; "
        f"rate limit per key: {rate_limit or 'none'}"
    )
    admin = [admin_token] if admin_token else []
    return replace(config.with_api_keys(keys).with_tokens(read, admin), rate_limit_rps=rate_limit)


def prefill_timeouts(scenario: Scenario, factor: float) -> dict[str, float]:
    """Per model, how long the gateway waits for a prefill instance's answer: `factor` x its TTFT SLO (none when
    `factor` is 0)."""
    return {m.model: factor * m.prefill_slo_ms / 1e3 for m in scenario.models} if factor > 0 else {}


def token_timeouts(scenario: Scenario, factor: float) -> dict[str, float]:
    """Per model, how long a streamed answer may go without a chunk, and per output token in the bound of a
    whole answer: `factor` x its TPOT SLO (none when `factor` is 0)."""
    return {m.model: factor * m.decode_slo_ms / 1e3 for m in scenario.models} if factor > 0 else {}


def shed_option(value: str, allowed: tuple[ShedMode, ...]) -> ShedMode:
    """`--shed VALUE` checked against the modes the command offers."""
    for mode in allowed:
        if value == mode:
            return mode
    raise CoralInputError(f"--shed {value!r}: must be one of {', '.join(allowed)}")


def run_server(app: FastAPI, host: str, port: int, grace_s: float) -> None:
    """Serve `app` until SIGTERM/SIGINT, then drain for at most `grace_s` (a second signal: at once)."""
    from coral.http_serving import DrainingServer, server_config

    DrainingServer(server_config(app, host, port, grace_s=grace_s)).run()


def allocator_planner(
    scenario_name: str,
    running: Callable[[], Plan | None],
    out: Path = DEFAULT_OUT,
    observe: Callable[[], ObservedDemand] | None = None,
    interval_s: float = 60.0,
    market: MarketWatcher | None = None,
    initial: Plan | None = None,
) -> Callable[[], Plan]:
    """Planner running the allocator on the scenario's template library (built by `coral templates build`),
    warm from the `running` plan so unchanged instances are kept. Without `observe` it plans the scenario's
    demand; with it (what the gateway saw since the last call, one call per `interval_s`: `TrafficMeter.observe`)
    each call re-plans for the forecast of the coming interval's traffic × the scenario's headroom × the
    latency correction (`coral.allocation.forecast`), holding (model, phase)s already within 25 % above it and
    keeping at least one instance of each, idle or not (`coral.simulation.replan.allocator_replanner`, the
    re-planner the simulator measures). With `initial` (the scenario's current plan, SLO-true: `coral run`) the
    first call serves it, and re-plans keep its headroom per (model, phase) as a floor: never less capacity than
    that headroom × the traffic observed (the forecast is raised to the observed mean). With `market`, every plan
    is made in the market it last published (offerings, prices and availability: `coral.runtime.market`)."""
    from coral.templates.library import TemplateLibrary

    try:
        from coral.allocation.allocator import allocate
        from coral.allocation.forecast import DemandForecaster, LatencyCorrection
        from coral.simulation.replan import allocator_replanner
    except ImportError:
        raise CoralInputError("the allocator is not available in this build; pass --plan PLAN.json") from None
    scenario = load_scenario(scenario_name)
    path = library_path(scenario_name, out)
    if not path.exists():
        raise CoralInputError(
            f"{path}: no template library; run `coral templates build {scenario_name}` first"
        )
    library = TemplateLibrary.load(path)
    if observe is None:
        def once() -> Plan:
            avail = market.snapshot.availability if market is not None else None
            return allocate(library, scenario, running=running(), availability=avail,
                            catalog=market.catalog() if market is not None else None)

        return once
    replan = allocator_replanner(library, scenario, forecaster=DemandForecaster(interval_s), initial=initial,
                                 correction=LatencyCorrection.for_scenario(scenario), hold=0.25, floor_tokens_s=1.0,
                                 at_least_observed=initial is not None)

    def plan() -> Plan:
        observed = observe() if market is None else market.apply(observe())
        return replan(observed.epoch, observed, running())

    return plan


def replan_words(old: Plan | None, new: Plan) -> str | None:
    """One line saying what a re-plan changed and why (the capacity each changed (model, phase) asks for now);
    None when `new` is `old` again (the same instances)."""
    from coral.report.view import plan_fingerprint

    if old is not None and plan_fingerprint(old) == plan_fingerprint(new):
        return None
    if old is None:
        return (f"plan: ${new.cost_per_hour:,.2f}/h, {len(new.instances)} instances ({new.method}, "
                f"{new.scenario})")
    before = {(s.model, s.phase): s.capacity for s in old.serving}
    why = [f"{s.model}/{s.phase} asks {s.demand:,.0f} tok/s (capacity {before.get((s.model, s.phase), 0.0):,.0f} -> "
           f"{s.capacity:,.0f})" for s in new.serving
           if abs(s.capacity - before.get((s.model, s.phase), 0.0)) > 1e-6 * max(1.0, s.capacity)]
    return (f"re-plan: ${old.cost_per_hour:,.2f}/h -> ${new.cost_per_hour:,.2f}/h, {len(old.instances)} -> "
            f"{len(new.instances)} instances: " + ("; ".join(why) or "same capacity, other instances"))


def logged_planner(planner: Callable[[], Plan], running: Callable[[], Plan | None],
                   say: Callable[[str], None]) -> Callable[[], Plan]:
    """`planner` that says (`replan_words`) every plan that differs from the running one."""
    def plan() -> Plan:
        new = planner()
        line = replan_words(running(), new)
        if line is not None:
            say(line)
        return new

    return plan


def static_registry(spec: EndpointsFile) -> Registry:
    """A registry of ready endpoints from an endpoints file (health checks take unreachable ones out)."""
    from coral.runtime.registry import Endpoint, InstanceState, Registry

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
    scenario: Scenario | None = None,
    catalog: Callable[[], Catalog] | None = None,
    limits: PlanLimits | None = None,
    shedder: Shedder | None = None,
) -> tuple[FastAPI, Controller]:
    """Gateway app with the controller API (`/state`, `/replan`; `admin_token` guards `/replan`) and dashboard
    mounted, and its controller. The gateway sends the engines the store's `engine_token`, and sheds with
    `shedder` (`create_gateway_app`). A plan posted to `/replan` is checked against `catalog()` (default: the
    built-in catalog), the `scenario` served (None: any) and `limits` (default: `PlanLimits()`)."""
    from coral.allocation.plan_check import PlanLimits
    from coral.catalog.loader import builtin_catalog
    from coral.report.dashboard import make_router
    from coral.runtime.controller import Controller, controller_router, runtime_state_provider
    from coral.runtime.gateway import GatewayConfig, create_gateway_app
    from coral.runtime.registry import Registry

    registry = Registry(expected=frozenset(m.model for m in scenario.models) if scenario is not None else frozenset())
    controller = Controller(store, backend, registry, planner, interval_s=interval_s, ready_timeout_s=ready_timeout_s)
    config = replace(config or GatewayConfig(), upstream_api_key=store.engine_token())
    app = create_gateway_app(registry, config, shedder=shedder)
    provider = runtime_state_provider(controller, app.state.gateway)
    app.include_router(controller_router(controller, app.state.gateway.state, admin_token,
                                         catalog=catalog or builtin_catalog, scenario=scenario,
                                         limits=limits or PlanLimits()))
    app.include_router(make_router(provider))
    return app, controller


#: what `coral status --json` keeps of each instance and action of the controller's /state
INSTANCE_FIELDS = ("id", "model", "phase", "region", "state", "healthy", "inflight", "served", "failed", "target_share",
                   "observed_share")
ACTION_FIELDS = ("seq", "kind", "instance_id", "status", "detail")


def status_summary(state: dict[str, Any]) -> dict[str, Any]:
    """What `coral status` shows, as data: the plan (scenario, method, instances, $/h), each instance, the ten
    latest actions and the controller's last error."""
    plan = state.get("plan")
    return {
        "plan": {"scenario": plan["scenario"], "method": plan["method"], "instances": len(plan["instances"]),
                 "cost_per_hour": plan["cost_per_hour"]} if plan else None,
        "instances": [{k: i.get(k) for k in INSTANCE_FIELDS} for i in state["instances"]],
        "actions": [{k: a.get(k) for k in ACTION_FIELDS} for a in state["actions"][:10]],
        "last_error": state.get("last_error"),
    }


def register(app: typer.Typer) -> None:
    """Add `serve` and `status` to `app`."""

    @app.command("serve")
    @friendly_errors
    def serve(
        scenario: str = typer.Argument("core", help="built-in scenario name or scenario YAML"),
        backend: str = typer.Option(
            "emulated",
            help="emulated | vllm (local `vllm serve` per single-node instance) | coral (the Coral pipeline "
            "engine, one process per node on this machine)",
        ),
        plan: Path | None = typer.Option(
            None, help="serve this plan (re-read every interval) instead of re-planning (default: start from the "
            "scenario's current plan, the one `coral run` chose, and re-plan every --interval on the traffic "
            "observed, never below that plan's SLO-true headroom; with none, plan with the allocator)"
        ),
        host: str = typer.Option("127.0.0.1"),
        port: int = typer.Option(8080),
        time_scale: float = typer.Option(
            1.0, help="multiplies the emulated engines' perf-model delays (the gateway's shedding buckets and the "
            "re-planner's traffic readings go by the engines' time alike)"),
        interval: float = typer.Option(60.0, help="seconds between allocator runs"),
        market: str | None = typer.Option(
            None, help="market file or http(s) URL (a MarketSnapshot: offerings and availability), re-read every "
            "--market-poll seconds; a change re-plans at once"
        ),
        market_poll: float = typer.Option(30.0, help="seconds between reads of --market"),
        db: Path | None = typer.Option(
            None, help="controller state file (default out/<scenario>.runtime.sqlite)"
        ),
        gpus: str = typer.Option("", help="vllm backend: GPU indices to hand out, e.g. '0,1,2,3'"),
        vllm_bin: str = typer.Option("vllm", help="vllm backend: the vllm executable"),
        checkpoint: Path | None = typer.Option(
            None, help="coral backend: checkpoint directory (default: a tiny model of each plan model's architecture, made once)"
        ),
        ray: bool = typer.Option(
            False, "--ray", help="coral backend: run the instances on a Ray cluster, each plan node on a Ray node "
            "advertising the resource coral-node/<config> (RAY_ADDRESS, or a local multi-node cluster started here)"
        ),
        engine_host: str = typer.Option(
            "", help="coral backend with --ray: address the engines bind to (default: each Ray node's IP)"
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
        read_tokens_file: Path | None = typer.Option(None, help=READ_HELP),
        grace: float = typer.Option(30.0, help=GRACE_HELP),
        instance_header: bool = typer.Option(
            False, "--instance-header", help="name the instance that made each answer in an x-coral-instance "
            "header (internal plan ids; off by default: then only requests bearing the admin token in "
            "X-Coral-Admin-Token see it)"
        ),
        max_instances: int = typer.Option(256, min=1, help="most instances a plan posted to /replan may have"),
        max_nodes: int = typer.Option(1024, min=1, help="most nodes (in all its instances) a plan posted to /replan "
                                      "may ask for"),
        slo_timeout: float = typer.Option(
            10.0, help="an instance that has not answered the prefill call or sent an answer's first token within this "
            "many times the model's TTFT SLO, gone this many times its TPOT SLO without a token, or not finished an "
            "answer within this many times (TTFT SLO + max_tokens x TPOT SLO) (times --time-scale for emulated "
            "engines) is timed out, not retried elsewhere, and ejected for a while; 0 = off"
        ),
        shed: str = typer.Option(
            "plan", help="plan | always | off: refuse each model's requests beyond its capacity at once (429 "
            "model_over_capacity with Retry-After) while the plan in force serves only a share of some model's "
            "demand or a model lost instances until they are replaced (plan), always, or never"
        ),
    ) -> None:
        """Run controller + gateway + engines; OpenAI API on http://HOST:PORT/v1, state on /state."""
        from coral.allocation.plan import Plan
        from coral.allocation.plan_check import PlanLimits
        from coral.allocation.shedding import Shedder
        from coral.catalog.loader import market_catalog
        from coral.runtime.backends import EmulatedBackend, VllmProcessBackend
        from coral.runtime.controller import Store
        from coral.runtime.gateway import GatewayConfig, load_secrets
        from coral.runtime.traffic import TrafficMeter

        shed_mode = shed_option(shed, ("plan", "always", "off"))
        db_path = db or DEFAULT_OUT / f"{Path(scenario).stem}.runtime.sqlite"
        store = Store(db_path)
        if store.notice:
            console.print(f"[yellow]warning:[/] {escape(store.notice)}")
        slos = load_scenario(scenario)
        engine_time = time_scale if backend == "emulated" and time_scale > 0 else 1.0  # clock s per engine s
        engines: EmulatedBackend | VllmProcessBackend | CoralEngineBackend
        if backend == "emulated":
            engines = EmulatedBackend(time_scale=time_scale, scenario=slos, api_key=store.engine_token())
        elif backend == "vllm":
            try:
                ids = [int(g) for g in gpus.split(",") if g.strip()]
            except ValueError:
                raise CoralInputError(f"--gpus {gpus!r}: must be comma-separated integers") from None
            engines = VllmProcessBackend(
                ids, [vllm_bin], log_dir=DEFAULT_OUT / "vllm-logs", api_key=store.engine_token()
            )
        elif backend == "coral" and ray:
            from coral.runtime.ray_backend import RayCoralBackend

            engines = on_ray = RayCoralBackend(checkpoint, log_dir=DEFAULT_OUT / "engine-logs",
                                               api_key=store.engine_token(), host=engine_host)
        elif backend == "coral":
            from coral.runtime.coral_backend import CoralEngineBackend

            engines = CoralEngineBackend(checkpoint, log_dir=DEFAULT_OUT / "engine-logs", api_key=store.engine_token())
        else:
            raise CoralInputError(
                f"--backend {backend!r}: must be 'emulated', 'vllm' or 'coral'; for clusters render manifests with `coral deploy`"
            )
        if ray and backend != "coral":
            raise CoralInputError(f"--ray: runs the Coral engine (--backend coral), not --backend {backend}")
        meter = TrafficMeter(slos, time_scale=engine_time)  # reads the gateway once build_runtime has made it
        if plan is not None:
            Plan.load(plan)  # fail now on a bad file
            plan_path = plan
            planner: Callable[[], Plan] = lambda: Plan.load(plan_path)  # noqa: E731
        scenario_market = market_catalog(slos)
        watcher = None
        if market is not None:
            if plan is not None:
                raise CoralInputError("--market: plans are made by the allocator; drop --plan to use a market")
            from coral.runtime.market import MarketWatcher

            watcher = MarketWatcher(market, slos, scenario_market, poll_s=market_poll)
        if plan is None:
            current = current_plan_path(scenario)
            initial = Plan.load(current) if current.is_file() else None
            if initial is not None:
                err_console.print(f"plan: {escape(str(current))}, the current plan of {escape(scenario)} (chosen by "
                                  f"`coral run`), ${initial.cost_per_hour:,.2f}/h; re-planned every {interval:g} s "
                                  f"on the traffic observed, never below its headroom")
            else:
                err_console.print(f"plan: {escape(scenario)} has no current plan ({escape(str(current))}; `coral "
                                  f"run {escape(scenario)}` writes it): planning with the allocator")
            planner = allocator_planner(scenario, store.plan, observe=meter.observe, interval_s=interval,
                                        market=watcher, initial=initial)
        planner = logged_planner(planner, store.plan, lambda line: err_console.print(escape(line)))
        admin = load_secrets(ADMIN_TOKEN_ENV, admin_token_file)
        if len(admin) > 1:
            raise CoralInputError(f"{admin_token_file or ADMIN_TOKEN_ENV}: holds more than one admin token")
        scale = max(1.0, time_scale) if backend == "emulated" else 1.0
        timeouts = GatewayConfig(
            prefill_timeout_s=prefill_timeouts(slos, slo_timeout * scale),
            token_timeout_s=token_timeouts(slos, slo_timeout * scale),
            instance_header=instance_header,
            shed=shed_mode,
        )
        cfg = access_config(
            timeouts, api_keys_file, rate_limit, host, read_tokens_file,
            admin[0] if admin else None,
        )
        if not admin and host not in ("127.0.0.1", "localhost", "::1"):
            console.print(f"[yellow]warning:[/] POST /replan is open to anyone reaching {host}")
        gw_app, controller = build_runtime(
            planner, store, engines, interval, cfg, admin[0] if admin else None,
            ready_timeout_s=ready_timeout or (60.0 if backend == "emulated" else 600.0),
            scenario=slos, catalog=watcher.catalog if watcher is not None else lambda: scenario_market,
            limits=PlanLimits(max_instances, max_nodes),
            shedder=Shedder.for_scenario(slos, engine_time),
        )
        meter.gateway = gw_app.state.gateway
        if backend == "coral" and ray:
            on_ray.on_change = lambda: controller.trigger(plan=False)  # an instance lost a Ray node: re-place it now
        controller.start()
        if watcher is not None:
            watcher.on_change = controller.trigger
            watcher.start()
        console.print(
            f"[green]coral serve[/] {scenario}: gateway http://{host}:{port}/v1, state /state, db {db_path}\n"
            f"dashboard http://{host}:{port}/dashboard" + ("?token=TOKEN (an API key or read token)" if cfg.guarded else "")
        )
        try:
            run_server(gw_app, host, port, grace)
        finally:
            if watcher is not None:
                watcher.stop()
            controller.stop()
            engines.close()

    @app.command("gateway")
    @friendly_errors
    def gateway(
        endpoints: Path = typer.Option(
            ..., help="endpoints.json written by `coral deploy` (filled by its sky-endpoints.sh or gateway.sh on skypilot "
            "and commands)"
        ),
        host: str = typer.Option("127.0.0.1", help="bind address (0.0.0.0 exposes it: set API keys)"),
        port: int = typer.Option(8080),
        max_concurrency: int = typer.Option(256, help="requests upstream at once"),
        max_waiting: int = typer.Option(1024, help="requests queued beyond that before 429"),
        api_keys_file: Path | None = typer.Option(None, help=KEYS_HELP),
        rate_limit: float = typer.Option(0.0, help=RATE_HELP),
        read_tokens_file: Path | None = typer.Option(None, help=READ_HELP),
        grace: float = typer.Option(30.0, help=GRACE_HELP),
        instance_header: bool = typer.Option(
            False, "--instance-header", help="name the instance that made each answer in an x-coral-instance "
            "header (internal plan ids; off by default: then only requests bearing the admin token in "
            "X-Coral-Admin-Token see it)"
        ),
        shed: str = typer.Option(
            "off", help="always | off: refuse each model's requests beyond its capacity (the endpoints' weights, "
            "tokens/s per phase, with 1 s of it as burst) at once with 429 model_over_capacity and Retry-After"
        ),
    ) -> None:
        """Serve the OpenAI API over deployed engines (static endpoints, no controller)."""
        from coral.deploy.endpoints import EndpointsFile
        from coral.runtime.gateway import GatewayConfig, create_gateway_app

        registry = static_registry(EndpointsFile.load(endpoints))
        cfg = GatewayConfig(max_concurrency=max_concurrency, max_waiting=max_waiting, instance_header=instance_header,
                            shed=shed_option(shed, ("always", "off")))
        cfg = access_config(cfg, api_keys_file, rate_limit, host, read_tokens_file)
        console.print(
            f"[green]coral gateway[/]: {len(registry.all())} endpoint(s) on http://{host}:{port}/v1"
        )
        run_server(create_gateway_app(registry, cfg), host, port, grace)

    @app.command("status")
    @friendly_errors
    def status(
        url: str = typer.Option(DEFAULT_URL, help="base URL of `coral serve`"),
        token: str = typer.Option(
            "", envvar="CORAL_TOKEN", show_default=False,
            help="API key or read-only token, when the gateway has keys (env CORAL_TOKEN)",
        ),
        as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    ) -> None:
        """Show the controller's plan, instances and recent actions."""
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            r = httpx.get(f"{url.rstrip('/')}/state", headers=headers, timeout=5)
        except httpx.HTTPError as exc:
            raise CoralInputError(
                f"--url {url}: cannot reach the controller ({type(exc).__name__})"
            ) from None
        if r.status_code != 200:
            hint = "; pass --token (or CORAL_TOKEN)" if r.status_code == 401 else ""
            raise CoralInputError(f"--url {url}: /state answered HTTP {r.status_code}{hint}")
        st = r.json()
        if as_json:
            print_json(status_summary(st))
            return
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
