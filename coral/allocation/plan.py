"""The plan: the allocator's output and the contract read by the simulator, runtime, deployers and report."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from coral.catalog.loader import load_file
from coral.catalog.schema import MAX_COST_PER_HOUR, MAX_TOKENS_S, Label, SafeName

PLAN_SCHEMA_VERSION = 1


TokensS = Annotated[float, Field(ge=0, le=MAX_TOKENS_S)]
"""A tokens/s figure: finite (every plan model refuses infinities and NaN), non-negative, within MAX_TOKENS_S."""
DollarsH = Annotated[float, Field(ge=0, le=MAX_COST_PER_HOUR)]


class _PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PlanStage(_PlanModel):
    first_layer: int = Field(ge=0)
    layers: int = Field(gt=0)
    nodes: list[SafeName] = Field(min_length=1, description="node config per data-parallel node of the stage")
    node_throughput: list[TokensS] = Field(description="tokens/s each node sustains under the SLO (router weights)")


class PlanClass(_PlanModel):
    """A request-length class a model was planned with (see coral.allocation.classes)."""

    name: Label
    share: float = Field(gt=0, le=1, description="fraction of the model's requests")
    mean_input_tokens: float = Field(gt=0)
    mean_output_tokens: float = Field(gt=0)
    max_input_tokens: float | None = Field(default=None, description="longest prompt of the class (None: no limit)")


class PlanInstance(_PlanModel):
    """One serving instance: a template instantiated once in one region."""

    id: SafeName = Field(description="stable id, e.g. 'qwen3-32b.prefill.t412.aws-us-east-2.0'")
    model: SafeName
    phase: Literal["prefill", "decode"]
    template_id: int = Field(ge=0)
    region: SafeName
    counts: dict[SafeName, int] = Field(description="nodes per config")
    stages: list[PlanStage]
    throughput: float = Field(gt=0, le=MAX_TOKENS_S, description="tokens/s under the SLO")
    cost_per_hour: DollarsH
    class_throughput: dict[Label, TokensS] | None = Field(
        default=None, description="tokens/s of each request class this instance is planned to serve (router weights "
        "per class); None: every class, in proportion to the throughput")

    @classmethod
    def of_stages(
        cls,
        model: str,
        phase: str,
        template_id: int,
        region: str,
        index: int,
        stages: Sequence[tuple[int, Sequence[str], Sequence[float]]],
        throughput: float,
        cost_per_hour: float,
        counts: dict[str, int] | None = None,
        class_throughput: dict[str, float] | None = None,
    ) -> PlanInstance:
        """An instance from (layers, node configs, node tokens/s) per stage; layer offsets, the node counts
        (unless given) and the id follow from them."""
        plan_stages, first = [], 0
        for layers, nodes, node_thr in stages:
            plan_stages.append(PlanStage(first_layer=first, layers=layers, nodes=list(nodes),
                                         node_throughput=list(node_thr)))
            first += layers
        if counts is None:
            counts = dict(Counter(n for _, nodes, _ in stages for n in nodes))
        return cls(
            id=f"{model}.{phase}.t{template_id}.{region}.{index}", model=model, phase=phase,  # type: ignore[arg-type]
            template_id=template_id, region=region, counts=counts, stages=plan_stages, throughput=throughput,
            cost_per_hour=cost_per_hour, class_throughput=class_throughput,
        )

    def weight_for(self, request_class: str | None) -> float:
        """Router weight of this instance for a request of `request_class` (None: no class)."""
        return class_weight(self.throughput, self.class_throughput, request_class)

    @property
    def n_nodes(self) -> int:
        return sum(self.counts.values())

    @property
    def heterogeneous(self) -> bool:
        return len(self.counts) > 1


class ModelServing(_PlanModel):
    """Demand against planned capacity for one (model, phase)."""

    model: str
    phase: Literal["prefill", "decode"]
    demand: TokensS = Field(description="tokens/s asked for")
    capacity: TokensS = Field(description="tokens/s planned")
    served_fraction: float = Field(ge=0, le=1, description="min(1, capacity/demand)")
    cost_per_hour: DollarsH
    traffic_tokens_s: TokensS | None = Field(
        default=None, description="mean tokens/s of the traffic the demand was sized from (demand / this = "
        "the headroom planned for bursts); None when not recorded")

    @property
    def headroom(self) -> float | None:
        """Planned capacity asked for ÷ mean traffic (None when the traffic was not recorded)."""
        return self.demand / self.traffic_tokens_s if self.traffic_tokens_s else None


class WindowStats(_PlanModel):
    """One model's SLO attainment over independent windows of traffic (request sets), the unit of its spread."""

    windows: int = Field(ge=0, description="request sets (windows) simulated")
    seeds: list[int] = Field(default_factory=list, description="workload seeds of the windows")
    pooled: float = Field(ge=0, le=1, description="requests meeting both SLOs over all windows' requests")
    lower_bound: float = Field(ge=0, le=1, description="one-sided lower confidence bound of the pooled attainment "
                               "(Student t over the windows' values, request-weighted)")
    confidence: float = Field(gt=0, lt=1, description="confidence of `lower_bound`")
    p5: float = Field(ge=0, le=1, description="5th percentile of the windows' attainment")
    p50: float = Field(ge=0, le=1, description="median window")
    worst: float = Field(ge=0, le=1, description="worst window")


class SloCheck(_PlanModel):
    """Simulated SLO attainment of a plan per model (both TTFT and TPOT met) against its target: on the requests
    the planner tuned on (cautiously: see `coral.planning.slo_search.worst_of`), and on held-out requests (other
    trace segments) it never saw."""

    target: dict[str, float] = Field(description="per model: the fraction of requests that must meet both SLOs")
    tuned: dict[str, float] = Field(description="per model: attainment on the tuning requests")
    held_out: dict[str, float] = Field(default_factory=dict,
                                       description="per model: attainment over all the held-out requests it was "
                                       "certified on (`certified`'s pooled)")
    held_out_worst: dict[str, float] = Field(default_factory=dict,
                                             description="per model: attainment on its worst held-out set alone")
    held_out_seeds: list[int] = Field(default_factory=list, description="workload seeds of the held-out sets")
    duration_s: float = Field(gt=0, description="simulated seconds per request set")
    certified: dict[str, WindowStats] = Field(
        default_factory=dict, description="per model: its attainment over the held-out windows it was certified on "
        "(`coral.planning.certify`); the verdict is on this")
    tail: float = Field(default=0.03, ge=0, le=1, description="how far under the target the 5th-percentile window "
                        "may fall in a passing verdict")
    certification_s: float = Field(default=0.0, ge=0, description="seconds the confirmation and certification took")
    certification_windows: int = Field(default=0, ge=0, description="request sets they simulated (a model's part "
                                       "alone counts as one)")
    verdict: dict[str, str] = Field(default_factory=dict,
                                    description="per model: 'pass', or 'fail: ' and why, with what would meet it")
    safety_net: str | None = Field(
        default=None, description="what the search's wall-clock safety net stopped (None: it ran on its round budget "
        "alone, so the same inputs give the same plan on any machine and load)")
    notes: list[str] = Field(default_factory=list,
                             description="what the search says of its result, e.g. that the chosen plan missed a "
                             "target on the tuning requests (no round met every one)")

    def passed(self, model: str) -> bool:
        return self.verdict.get(model, "").startswith("pass")


class SolveReport(_PlanModel):
    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    time_s: float = 0.0
    n_variables: int = 0
    n_constraints: int = 0
    notes: list[str] = Field(default_factory=list)
    safety_net: str | None = Field(
        default=None, description="what the wall-clock time limit, a safety net only, stopped (None: nothing; the "
        "solves stop on deterministic work limits, so the same inputs give the same plan on any machine and load, "
        "unless this is set)")
    stopped: list[str] = Field(
        default_factory=list, description="the stages a limit stopped before they proved their optimum within the "
        "gap, and which limit (a work limit, or the wall-clock safety net); empty: every stage proved its optimum")


def class_weight(weight: float, per_class: dict[str, float] | None, request_class: str | None) -> float:
    """Router weight for a request of `request_class`: the planned tokens/s of that class, or `weight` when the
    request has no class or the endpoint serves every class (`per_class` None)."""
    if request_class is None or per_class is None:
        return weight
    return per_class.get(request_class, 0.0)


def class_indices(classes: Sequence[PlanClass], input_tokens: np.ndarray) -> np.ndarray:
    """Index of each prompt's class: the first whose limit the prompt does not exceed (the last takes the rest)."""
    limits = np.maximum.accumulate([np.inf if c.max_input_tokens is None else c.max_input_tokens for c in classes])
    return np.minimum(np.searchsorted(limits, input_tokens, side="left"), len(classes) - 1)


def class_of(classes: Sequence[PlanClass], input_tokens: float) -> str | None:
    """The class name of one prompt (`class_indices`); None without classes."""
    return classes[int(class_indices(classes, np.array([input_tokens]))[0])].name if classes else None


class Plan(_PlanModel):
    schema_version: Literal[1] = 1
    scenario: str
    method: str = Field(description="coral | homo | cauchy | ...")
    mode: Literal["cost", "goodput", "maxmin", "scaled"] = "cost"
    engine: Literal["coral", "vllm"] = Field(
        default="coral", description="engine the plan was restricted to: coral runs every template, vllm only "
        "what stock vLLM launches"
    )
    target: Literal["skypilot", "kubernetes", "commands"] | None = Field(
        default=None, description="`coral deploy` target the plan was restricted to (`--target`, with engine vllm): "
        "made only of templates that target launches; None: no target"
    )
    demand_scale: float = Field(default=1.0, gt=0, description="uniform demand scale the plan was solved at")
    instances: list[PlanInstance]
    request_classes: dict[str, list[PlanClass]] = Field(
        default_factory=dict, description="per model planned with request-length classes, its classes, shortest first")
    serving: list[ModelServing]
    cost_per_hour: DollarsH = Field(description="provisioning $/h")
    penalty_per_hour: DollarsH = Field(default=0.0, description="amortised scale-up penalty $/h")
    solve: SolveReport
    slo: SloCheck | None = Field(default=None, description="simulated SLO attainment against each model's target "
                                 "(None: not checked)")
    created_at: str = ""

    @model_validator(mode="after")
    def _instance_ids_unique(self) -> Plan:
        twice = sorted((iid, n) for iid, n in Counter(i.id for i in self.instances).items() if n > 1)
        if twice:
            raise ValueError("instances: ids must be unique; " + ", ".join(f"{iid} appears {n} times"
                                                                            for iid, n in twice[:5]))
        return self

    def class_of(self, model: str, input_tokens: float) -> str | None:
        """The request class of a prompt of `input_tokens` for `model` (None when planned without classes)."""
        return class_of(self.request_classes.get(model, []), input_tokens)

    def instances_of(self, model: str, phase: str) -> list[PlanInstance]:
        return [i for i in self.instances if i.model == model and i.phase == phase]

    def model_shares(self) -> dict[str, float]:
        """Per model, the share of its demand served in both phases (the lesser of the two: a request needs
        both); 1 for a phase without demand."""
        out: dict[str, float] = {}
        for s in self.serving:
            out[s.model] = min(out.get(s.model, 1.0), s.served_fraction if s.demand > 0 else 1.0)
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return load_file(cls, path)
