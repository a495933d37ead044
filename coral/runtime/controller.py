"""Controller: keeps the running instances equal to the plan, through a backend, with state in SQLite.

Every `interval_s` (or on `/replan`) it asks the planner for a plan, stores it as the desired state, and
reconciles by instance id: missing instances are started (the intent is written before the backend call),
waited for on `/health` and registered in the gateway as ready with their planned tokens/s per request class
(the gateway's registry takes the plan, for its request classes and shedding; kept instances whose
plan entry changed are re-registered with the new weights); surplus instances are set draining in the gateway (no
new requests), stopped once their in-flight count reaches 0 (or after `drain_timeout_s`) and removed. Desired
instances, observed instances with their state and handle, and an action log live in one SQLite file, so a restarted
controller re-registers the instances that survived, and finishes pending starts and drains (their action
rows are completed, not duplicated).

An instance of the plan found dead (its backend says so: a crashed process, a lost Ray node) is marked
`failed` (a `lost` action), taken out of the gateway's routing and started again; while a start fails (no
capacity yet) it stays `failed` and the controller tries again every `retry_s`, without re-planning in between.
A death is noticed at once: a watchdog (`backends.Watchdog`) polls each running instance's `alive` every
`watch_s`; on a death the instance gets no more requests and the controller reconciles now, not at its next pass.
Each failed instance's row in `state()` says why (`last_error`: the start's exception, the backend's reason, else
its `/health` error), also while it is being started again; the controller's own `last_error` says why its last
pass failed. A plan posted to `/replan` is checked against the catalog, the scenario served and the caps
(`coral.allocation.plan_check`) before it is adopted.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from coral.allocation.plan import Plan, PlanInstance
from coral.allocation.plan_check import PlanLimits, check_plan
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog, validate
from coral.catalog.schema import Scenario
from coral.openai_shapes import InvalidRequest, bearer_token
from coral.runtime.backends import Backend, Handle, Watchdog
from coral.runtime.gateway import BodyRefused, error_response, parse_json, read_body
from coral.runtime.registry import Endpoint, InstanceState, Registry

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS desired(id TEXT PRIMARY KEY, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS observed(
  id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL, handle TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS actions(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL, instance_id TEXT NOT NULL,
  status TEXT NOT NULL, detail TEXT NOT NULL DEFAULT '');
"""
ACTIVE = ("starting", "ready", "draining")
STATES = (*ACTIVE, "failed", "stopped")


class Store:
    """Desired plan, observed instances and the action log in one SQLite file (thread-safe).

    A file that is not a SQLite database (or a corrupt one) is moved aside to `<name>.corrupt-<unix time>`, one
    whose stored plan or instances no longer validate to `<name>.invalid-<unix time>`, and a fresh database
    started (`notice` says so, and the action log's first row); a file that cannot be opened
    or written (permissions, a read-only file or folder) is refused with CoralInputError naming it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock = threading.RLock()
        self.notice = ""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.db = self._open()
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError as exc:
                self._start_afresh("corrupt", f"was not a readable SQLite database ({exc})")
            else:
                if (problem := self._invalid_contents()) is not None:
                    self.db.close()  # checkpoints the WAL into the file kept aside
                    self._start_afresh("invalid", f"holds a plan or instance that no longer validates ({problem})")
        except (sqlite3.OperationalError, OSError) as exc:
            raise CoralInputError(
                f"{self.path}: cannot open the controller state database for writing ({exc}); fix its "
                "permissions or pass --db with a writable path"
            ) from None

    def _start_afresh(self, why: str, what: str) -> None:
        """Keep the file aside as `<name>.<why>-<unix time>` and start an empty database; `notice` and the action
        log's first row say so."""
        backup = self.path.with_name(f"{self.path.name}.{why}-{int(time.time())}")
        self.path.replace(backup)
        for side in ("-wal", "-shm"):
            Path(f"{self.path}{side}").unlink(missing_ok=True)
        self.db = self._open()
        self.notice = f"{self.path} {what}: kept as {backup.name}, started empty"
        self.finish(self.begin("reset-state", "-"), "done", self.notice)

    def _invalid_contents(self) -> str | None:
        """Why the stored plan, desired or observed instances do not validate as this version's schema (e.g. a
        non-finite number an older version let in), else None."""
        try:
            self.plan()
            self.desired()
            self.observed(STATES)
        except ValidationError as exc:
            return f"{exc.error_count()} error(s), first: {_first_error(exc)}"
        except ValueError as exc:  # a handle that is not JSON
            return str(exc)[:200]
        return None

    def _open(self) -> sqlite3.Connection:
        self.path.touch(mode=0o600)  # owner-only: it holds the engines' token
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('opened_at', ?)", (str(time.time()),))  # writable?
        except sqlite3.Error:
            db.close()
            raise
        return db

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction, rolled back when anything in it fails: the file holds all of it or none of it, and
        the connection is never left inside an open transaction (every later write would fail)."""
        with self.lock:
            self.db.execute("BEGIN")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def set_plan(self, plan: Plan, pin: bool | None = None) -> None:
        """Store `plan` as the desired state (and, with `pin`, pin or release it in the same transaction)."""
        with self._transaction() as db:
            if pin is not None:
                db.execute("INSERT OR REPLACE INTO meta VALUES ('pinned', ?)", ("1" if pin else "0",))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('plan', ?)", (plan.model_dump_json(),))
            db.execute("DELETE FROM desired")
            db.executemany("INSERT INTO desired VALUES (?, ?)", [(i.id, i.model_dump_json()) for i in plan.instances])

    def engine_token(self) -> str:
        """The token the gateway sends its engines (made once and kept, so restarted runs reach the engines
        they adopt)."""
        with self.lock:
            row = self.db.execute("SELECT value FROM meta WHERE key='engine_token'").fetchone()
            if row:
                return str(row[0])
            token = secrets.token_urlsafe(32)
            self.db.execute("INSERT INTO meta VALUES ('engine_token', ?)", (token,))
            return token

    def pin(self, pinned: bool) -> None:
        """Pin the stored plan (the planner is not asked while pinned) or release it."""
        with self.lock:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('pinned', ?)", ("1" if pinned else "0",))

    def pinned(self) -> bool:
        with self.lock:
            row = self.db.execute("SELECT value FROM meta WHERE key='pinned'").fetchone()
        return bool(row and row[0] == "1")

    def plan(self) -> Plan | None:
        with self.lock:
            row = self.db.execute("SELECT value FROM meta WHERE key='plan'").fetchone()
        return Plan.model_validate_json(row[0]) if row else None

    def desired(self) -> dict[str, PlanInstance]:
        with self.lock:
            rows = self.db.execute("SELECT id, spec FROM desired ORDER BY id").fetchall()
        return {i: PlanInstance.model_validate_json(s) for i, s in rows}

    def observed(self, states: tuple[str, ...] = ACTIVE) -> dict[str, tuple[PlanInstance, str, Handle]]:
        marks = ",".join("?" * len(states))
        with self.lock:
            rows = self.db.execute(
                f"SELECT id, spec, state, handle FROM observed WHERE state IN ({marks}) ORDER BY id", states
            ).fetchall()
        return {i: (PlanInstance.model_validate_json(s), st, json.loads(h)) for i, s, st, h in rows}

    def observe(self, inst: PlanInstance, state: str, handle: Handle) -> None:
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO observed VALUES (?, ?, ?, ?, ?)",
                (inst.id, inst.model_dump_json(), state, json.dumps(handle), time.time()),
            )

    def begin(self, kind: str, instance_id: str) -> int:
        """The pending action (kind, instance) left by a previous run, or a new one."""
        with self.lock:
            row = self.db.execute(
                "SELECT seq FROM actions WHERE kind=? AND instance_id=? AND status='pending'",
                (kind, instance_id),
            ).fetchone()
            if row:
                return int(row[0])
            cur = self.db.execute(
                "INSERT INTO actions(ts, kind, instance_id, status) VALUES (?, ?, ?, 'pending')",
                (time.time(), kind, instance_id),
            )
            return int(cur.lastrowid or 0)

    def finish(self, seq: int, status: str, detail: str = "") -> None:
        with self.lock:
            self.db.execute(
                "UPDATE actions SET status=?, detail=?, ts=? WHERE seq=?", (status, detail, time.time(), seq)
            )

    def actions(self, limit: int = 50) -> list[dict[str, Any]]:
        with self.lock:
            rows = self.db.execute(
                "SELECT seq, ts, kind, instance_id, status, detail FROM actions ORDER BY seq DESC LIMIT ?",
                (limit,),
            ).fetchall()
        keys = ("seq", "ts", "kind", "instance_id", "status", "detail")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def failures(self) -> dict[str, str]:
        """Per instance down since its latest finished start, lost or drain action: why (a failed start's detail,
        or the `lost` action's); an instance started or drained since then has none."""
        with self.lock:
            rows = self.db.execute(
                "SELECT instance_id, kind, status, detail FROM actions WHERE kind IN ('start', 'lost', 'drain') "
                "AND status != 'pending' ORDER BY seq"
            ).fetchall()
        out: dict[str, str] = {}
        for iid, kind, status, detail in rows:
            if status == "failed" or kind == "lost":
                out[iid] = detail
            else:
                out.pop(iid, None)
        return out


class Controller:
    """Reconciles the backend's instances with the planner's plan; see the module docstring."""

    def __init__(
        self,
        store: Store,
        backend: Backend,
        registry: Registry,
        planner: Callable[[], Plan] | None = None,
        interval_s: float = 60.0,
        drain_timeout_s: float = 60.0,
        ready_timeout_s: float = 60.0,
        retry_s: float = 5.0,
        watch_s: float = 0.2,
    ) -> None:
        self.store = store
        self.backend = backend
        self.registry = registry
        self.planner = planner
        self.interval_s = interval_s
        self.drain_timeout_s = drain_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._plan_on_wake = True
        self.last_error = ""
        self.watchdog = Watchdog(backend.alive, self._died, watch_s)
        self.resume()

    # --- state transitions --------------------------------------------------------------------------
    def resume(self) -> None:
        """Re-register the instances a previous run left running; forget the ones that died meanwhile."""
        self._apply_routing()
        for iid, (inst, state, handle) in self.store.observed().items():
            if handle.get("url") and self.backend.alive(iid, handle):
                if state != "starting":
                    self._register(inst, handle, InstanceState(state))
            elif state != "starting":
                seq = self.store.begin("lost", iid)
                self.store.observe(inst, "stopped", handle)
                self.store.finish(seq, "done", "not running after controller restart")

    def _apply_routing(self) -> None:
        """Route by the stored plan's request classes, and shed by it (`coral.allocation.shedding`)."""
        plan = self.store.plan()
        self.registry.classes = plan.request_classes if plan is not None else {}
        self.registry.plan = plan

    def _register(self, inst: PlanInstance, handle: Handle, state: InstanceState) -> None:
        self.registry.add(Endpoint(inst.id, inst.model, inst.phase, handle["url"], inst.throughput, state,
                                   class_weights=inst.class_throughput))
        self.watchdog.watch(inst.id, handle)

    def _died(self, instance_id: str) -> None:
        """The watchdog found a running instance dead: no more requests to it, and reconcile now (it is marked
        failed and started again) instead of at the next pass."""
        ep = self.registry.get(instance_id)
        if ep is not None:
            ep.healthy = False
        self.trigger(plan=False)

    def _backend_failure(self, instance_id: str) -> str:
        """Why the backend says an instance stopped by itself ('' when it does not say)."""
        return str(getattr(self.backend, "failure", lambda _iid: "")(instance_id))

    def _wait_ready(self, instance_id: str, url: str) -> str:
        """'' once `url`'s `/health` answers 200 within `ready_timeout_s`, else why not: the backend's reason (a
        process that exited), else the last `/health` answer or connection error."""
        deadline = time.monotonic() + self.ready_timeout_s
        last = "/health never asked"
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline and not self._stop.is_set():
                try:
                    r = client.get(f"{url}/health")
                    if r.status_code == 200:
                        return ""
                    last = _answer_error(r)
                except httpx.HTTPError as exc:
                    last = f"/health unreachable ({type(exc).__name__}: {exc})"
                time.sleep(0.05)
        return f"not healthy within {self.ready_timeout_s:g} s: {self._backend_failure(instance_id) or last}"

    def start_instance(self, inst: PlanInstance) -> None:
        """Start `inst` and wait for its health; a start that raises or is not healthy in time leaves it `failed`
        with the reason (its start action's detail, the `last_error` of its row in `state()`)."""
        seq = self.store.begin("start", inst.id)
        self.store.observe(inst, "starting", {})
        try:
            handle = self.backend.start(inst)
        except Exception as exc:
            self.store.observe(inst, "failed", {})
            self.store.finish(seq, "failed", f"{type(exc).__name__}: {exc}")
            return
        self.store.observe(inst, "starting", handle)
        if why := self._wait_ready(inst.id, handle["url"]):
            self.backend.stop(inst.id, handle)
            self.store.observe(inst, "failed", handle)
            self.store.finish(seq, "failed", why)
            return
        self._register(inst, handle, InstanceState.READY)
        self.store.observe(inst, "ready", handle)
        self.store.finish(seq, "done", handle["url"])

    def drain_instance(self, inst: PlanInstance, handle: Handle) -> None:
        self.watchdog.forget(inst.id)
        seq = self.store.begin("drain", inst.id)
        self.store.observe(inst, "draining", handle)
        self.registry.set_state(inst.id, InstanceState.DRAINING)
        deadline = time.monotonic() + self.drain_timeout_s
        ep = self.registry.get(inst.id)
        while ep is not None and ep.inflight > 0 and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.02)
        left = ep.inflight if ep is not None else 0
        self.backend.stop(inst.id, handle)
        self.registry.remove(inst.id)
        self.store.observe(inst, "stopped", handle)
        self.store.finish(seq, "done", f"stopped with {left} in flight" if left else "drained")

    @contextlib.contextmanager
    def _recorded(self) -> Iterator[None]:
        """Keep `last_error` (shown in `state()`): the error a pass failed with, '' once one succeeds."""
        try:
            yield
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise
        self.last_error = ""

    def reconcile(self) -> dict[str, list[str]]:
        """One pass: start what is missing (scale-ups first), then drain and stop what is surplus."""
        with self._lock, self._recorded():
            self._apply_routing()
            desired = self.store.desired()
            observed = self.store.observed()
            started, stopped = [], []
            for iid, inst in desired.items():
                obs = observed.get(iid)
                if obs is not None and obs[1] != "starting" and not self.backend.alive(iid, obs[2]):
                    self._lost(obs[0], obs[2])
                    obs = None
                if obs is None or obs[1] == "starting":
                    self.start_instance(inst)  # new, interrupted or failed start, or died while planned: (re)start
                    started.append(iid)
                elif obs[1] == "draining" or obs[0] != inst:  # back before its drain finished, or re-weighted
                    self._register(inst, obs[2], InstanceState.READY)
                    self.store.observe(inst, "ready", obs[2])
            for iid, (inst, _state, handle) in observed.items():
                if iid not in desired:
                    if self.backend.alive(iid, handle):
                        self.drain_instance(inst, handle)
                    else:  # nothing left to drain
                        self._lost(inst, handle)
                        self.store.observe(inst, "stopped", handle)
                    stopped.append(iid)
            return {"started": started, "stopped": stopped}

    def _lost(self, inst: PlanInstance, handle: Handle) -> None:
        """An instance died: out of the gateway, marked failed, with the backend's reason if it gives one, else
        its `/health` answer's."""
        self.watchdog.forget(inst.id)
        self.registry.remove(inst.id)
        self.store.observe(inst, "failed", handle)
        reason = self._backend_failure(inst.id) or _health_error(handle.get("url"))
        self.store.finish(self.store.begin("lost", inst.id), "done", reason or "not running")

    def failed(self) -> list[str]:
        """Planned instances that are down (their last start failed or they died)."""
        desired = self.store.desired()
        return [iid for iid in self.store.observed(("failed",)) if iid in desired]

    def set_plan(self, plan: Plan, pin: bool | None = None) -> None:
        self.store.set_plan(plan, pin)

    def replan(self) -> dict[str, list[str]]:
        """Ask the planner (if any, and the plan is not pinned) for a new plan, then reconcile."""
        with self._recorded():
            if self.planner is not None and not self.store.pinned():
                self.set_plan(self.planner())
            return self.reconcile()

    # --- loop ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        plan_next, planned_at = True, 0.0
        while not self._stop.is_set():
            with contextlib.suppress(Exception), self._recorded():  # keep reconciling: the error is in /state
                if plan_next and self.planner is not None and not self.store.pinned():
                    planned_at = time.monotonic()
                    self.replan()
                else:
                    self.reconcile()
            woke = self._wake.wait(self.retry_s if self.failed() else self.interval_s)
            self._wake.clear()
            due = time.monotonic() - planned_at >= self.interval_s
            plan_next, self._plan_on_wake = (woke and self._plan_on_wake) or due, True

    def start(self) -> Controller:
        self._thread = threading.Thread(target=self._loop, name="coral-controller", daemon=True)
        self._thread.start()
        self.watchdog.start()
        return self

    def trigger(self, plan: bool = True) -> None:
        """Wake the loop now; `plan=False` reconciles the stored plan without asking the planner."""
        self._plan_on_wake = plan
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self.watchdog.stop(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def state(self, gateway_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The runtime state read by `/state`, `coral status` and the dashboard (`coral.report.dashboard`):

        {"plan": Plan JSON | None,
         "instances": [{id, model, phase, region, template_id, counts, throughput, class_throughput,
                        cost_per_hour, desired, state (pending|starting|ready|draining|failed), url,
                        last_error (why it went down or its last start failed, while it is failed or being
                        started again; else ''),
                        healthy, weight, inflight, served, failed, target_share, observed_share}],
         "traffic": {model: {phase: {instance id: observed share}}},
         "latency": {model: {requests, errors, count, p50_ms, p99_ms (end to end), and where measured
                    ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms}},
         "queue": {waiting, active}, "actions": [{seq, ts, kind, instance_id, status, detail}] (newest
         first), "pinned": whether a posted plan holds off the planner, "last_error": why the controller's
         last pass (planning and reconciling) failed, '' when it succeeded,
         "updated_at": unix seconds}
        """
        plan = self.store.plan()
        desired = self.store.desired()
        observed = self.store.observed(STATES)
        gw = gateway_state or {"instances": [], "latency": {}, "queue": {}}
        live = {e["id"]: e for e in gw["instances"]}
        instances: list[dict[str, Any]] = []
        failures = self.store.failures() if any(o[1] in ("failed", "starting") for o in observed.values()) else {}
        for iid in sorted(set(desired) | {i for i, o in observed.items() if o[1] != "stopped"}):
            inst = desired.get(iid) or observed[iid][0]
            obs = observed.get(iid)
            row: dict[str, Any] = {
                "id": iid,
                "model": inst.model,
                "phase": inst.phase,
                "region": inst.region,
                "template_id": inst.template_id,
                "counts": inst.counts,
                "throughput": inst.throughput,
                "class_throughput": inst.class_throughput,
                "cost_per_hour": inst.cost_per_hour,
                "desired": iid in desired,
                "state": obs[1] if obs else "pending",
                "url": obs[2].get("url", "") if obs else "",
            }
            row["last_error"] = failures.get(iid, "")
            g = live.get(iid, {})
            for k in ("healthy", "weight", "inflight", "served", "failed", "target_share", "observed_share"):
                row[k] = g.get(k, 0 if k != "healthy" else False)
            instances.append(row)
        traffic: dict[str, dict[str, dict[str, float]]] = {}
        for r in instances:
            traffic.setdefault(r["model"], {}).setdefault(r["phase"], {})[r["id"]] = r["observed_share"]
        return {
            "plan": plan.model_dump(mode="json") if plan is not None else None,
            "instances": instances,
            "traffic": traffic,
            "latency": gw.get("latency", {}),
            "queue": gw.get("queue", {}),
            "actions": self.store.actions(),
            "pinned": self.store.pinned(),
            "last_error": self.last_error,
            "updated_at": time.time(),
        }


def _first_error(exc: ValidationError) -> str:
    """'field.path: message' of the first error of `exc`."""
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"


def _health_error(url: str | None) -> str:
    """What a stopped instance's `/health` says when it answers with an error ('' when it does not answer)."""
    if not url:
        return ""
    try:
        r = httpx.get(f"{url}/health", timeout=1.0)
    except httpx.HTTPError:
        return ""
    return "" if r.status_code == 200 else _answer_error(r)


def _answer_error(r: httpx.Response) -> str:
    """'/health answered STATUS: the error message' (or the start of the body when it is not an OpenAI error)."""
    try:
        detail = str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        detail = r.text[:200]
    return f"/health answered {r.status_code}: {detail}"


def controller_router(
    controller: Controller,
    gateway_state: Callable[[], dict[str, Any]] | None = None,
    admin_token: str | None = None,
    max_body_bytes: int = 16 << 20,
    body_timeout_s: float = 30.0,
    catalog: Callable[[], Catalog] = builtin_catalog,
    scenario: Scenario | None = None,
    limits: PlanLimits = PlanLimits(),
) -> APIRouter:
    """`GET /state` and `POST /replan`: with a plan JSON body, adopt it and pin it (the planner is not asked
    until `POST /replan?release=true`); without a body, ask the planner now (409 while pinned); `?wait=true`
    reconciles before answering. With `admin_token`, `/replan` needs `Authorization: Bearer ADMIN_TOKEN` (401
    otherwise). Every error is JSON in OpenAI's shape with the reason; bodies past `max_body_bytes` get 413
    however they are framed.

    A posted plan is checked as `coral deploy` checks one (`coral.allocation.plan_check`), against the catalog
    `catalog()` returns (the market's, where it changes), the `scenario` served (its models, regions and node
    configs; None: any) and the caps of `limits`: a plan failing any check gets 400 `invalid_plan` listing each
    problem (field path: reason) and nothing is stored (the running plan and its pin stay). A pass that fails
    under `?wait=true` gets 500 `reconcile_failed` with the reason (also `last_error` in `/state`)."""
    router = APIRouter()
    expected = admin_token.encode() if admin_token else None

    def denied(request: Request) -> JSONResponse | None:
        if expected is None:
            return None
        given = bearer_token(request.headers.get("authorization", "")).encode()
        if hmac.compare_digest(given, expected):
            return None
        msg = "this endpoint needs the controller's admin token: `Authorization: Bearer TOKEN`"
        return error_response(401, msg, "invalid_admin_token")

    def snapshot() -> dict[str, Any]:
        return controller.state(gateway_state() if gateway_state else None)

    @router.get("/state")
    async def state() -> dict[str, Any]:
        return snapshot()

    @router.post("/replan")
    async def replan(request: Request, wait: bool = False, release: bool = False) -> Any:
        if (refused := denied(request)) is not None:
            return refused
        source = "POST /replan body"
        try:
            raw = await read_body(request, max_body_bytes, body_timeout_s)
            plan = validate(Plan, parse_json(raw), source) if raw.strip() else None
            if plan is not None:
                check_plan(plan, catalog(), source, scenario, limits, "nothing was adopted: the running plan stays")
        except BodyRefused as exc:
            return exc.response()
        except (CoralInputError, InvalidRequest) as exc:
            return error_response(400, str(exc), "invalid_plan")
        if plan is not None and release:
            return error_response(400, "release=true takes no plan body", "invalid_plan")
        if plan is None and not release and controller.store.pinned():
            msg = "the plan posted to /replan is pinned: POST /replan?release=true hands planning back"
            return error_response(409, msg, "plan_pinned")
        try:
            if plan is not None:  # pinned with it, in one transaction: a planner tick cannot replace it
                controller.set_plan(plan, pin=True)
            elif release:
                controller.store.pin(False)
            if wait:
                await run_in_threadpool(controller.reconcile if plan is not None else controller.replan)
            else:
                controller.trigger(plan=plan is None)
        except sqlite3.Error as exc:
            msg = f"controller state {controller.store.path} cannot be written: {exc}"
            return error_response(503, msg, "state_unwritable")
        except Exception as exc:  # the pass failed (a backend error): said here and in /state until one succeeds
            msg = f"the controller's pass failed: {type(exc).__name__}: {exc}"
            return error_response(500, msg, "reconcile_failed")
        return snapshot()

    return router


def runtime_state_provider(controller: Controller, gateway: Any) -> Callable[[], dict[str, Any]]:
    """Zero-argument callable returning `Controller.state` merged with the gateway's counters (dashboard)."""
    return lambda: controller.state(gateway.state())
