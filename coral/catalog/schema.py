"""Versioned pydantic schemas for every input file Coral reads (GPUs, offerings, models, scenarios)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from coral.catalog.suggest import did_you_mean

SCHEMA_VERSION = 1

SAFE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$"
SafeName = Annotated[str, Field(pattern=SAFE_NAME_PATTERN)]
"""Ids and names rendered into scripts, manifests and metric labels: 1-128 characters, a letter or digit first,
then letters, digits and `. _ : + -` (no whitespace, quotes or shell metacharacters)."""


def printable(value: str) -> str:
    """`value` when it is printable text (no control characters, line breaks or lone surrogates), else ValueError."""
    if not value.isprintable():
        raise ValueError("must be printable text: no control characters, line breaks or lone surrogates")
    return value


def shown(text: str, keep: str = "") -> str:
    """`text` safe to print: every non-printable character (control characters, terminal escapes, line breaks, lone
    surrogates) but those in `keep` written as its Python escape (`\\n`, `\\x1b`, `\\ud800`), the rest as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else c.encode("unicode_escape").decode("ascii") for c in text)


Label = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(printable)]
"""A name shown in tables and logs and used as a key (a request class's): 1-128 printable characters."""

MAX_TOKENS_S = 1e12
"""Tokens/s any one figure of a plan or endpoints file may state (far above any fleet): sums of them stay finite."""
MAX_COST_PER_HOUR = 1e9
"""$/h any one figure of a plan may state."""

# Bounds on what a scenario may ask for, far above the built-in scenarios and the paper's settings (extended: 6
# models, 20 configs, 3 regions, 5 epochs of 6 minutes, 150 requests/s in all), so that a scenario file cannot make
# a run take unbounded memory or time.
MAX_SCENARIO_MODELS = 256  # the scale benchmark plans 48 models; 256 keeps far clear of it
MAX_SCENARIO_REGIONS = 64
MAX_SCENARIO_CONFIGS = 64
MAX_REQUEST_CLASSES = 16
MAX_EPOCHS = 1000
MAX_EPOCH_MINUTES = 24 * 60
MAX_NODE_SETS = 5_000_000
"""Node multisets of up to `n_max` nodes over the configs, per (model, phase) (extended: 230,229)."""
MAX_RUN_REQUESTS = 10_000_000
"""Requests one run of the scenario simulates: total request rate x epochs x epoch length (extended: 270,000)."""
MAX_SCHEDULE_STEPS = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GpuSpec(_Strict):
    """One GPU type, per-GPU figures."""

    name: str = Field(min_length=1)
    memory_gb: float = Field(gt=0, description="HBM/GDDR capacity in GB (1e9 bytes)")
    fp16_tflops: float = Field(gt=0, description="dense FP16 tensor-core TFLOP/s")
    bf16_tflops: float | None = Field(default=None, gt=0, description="dense BF16 TFLOP/s; None = no BF16")
    mem_bw_gbs: float = Field(gt=0, description="memory bandwidth, GB/s")
    interconnect: Literal["nvlink", "pcie"]
    intra_node_bw_gbs: float = Field(gt=0, description="per-GPU, per-direction GPU-to-GPU bandwidth, GB/s")
    source: str

    @property
    def tflops(self) -> float:
        """Dense half-precision throughput used for serving (BF16 where supported, else FP16)."""
        return self.bf16_tflops if self.bf16_tflops is not None else self.fp16_tflops


class GpuCatalog(_Strict):
    schema_version: Literal[1] = 1
    source_date: str
    gpus: list[GpuSpec]

    @field_validator("gpus")
    @classmethod
    def _unique(cls, gpus: list[GpuSpec]) -> list[GpuSpec]:
        names = [g.name for g in gpus]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate GPU names: {sorted(dup)}")
        return gpus


class NodeOffering(_Strict):
    """A rentable instance shape in one cloud region with its on-demand price."""

    cloud: Literal["aws", "gcp", "azure", "other"]
    region: str
    instance_type: str
    gpu: str
    gpus_per_node: Literal[1, 2, 4, 8]
    price_per_hour: float = Field(gt=0, description="$/node-hour, on demand, host included")
    vcpus: int = Field(gt=0)
    host_memory_gb: float = Field(gt=0)
    nic_gbps: float = Field(gt=0, description="node network bandwidth, Gbit/s")
    price_date: str
    source: str
    available: int | None = Field(
        default=None, ge=0, description="nodes of this instance type the region can rent (a scenario with "
        "`availability: market` plans within it); unset: as many as asked")

    @property
    def config(self) -> str:
        return config_name(self.gpu, self.gpus_per_node)


class OfferingCatalog(_Strict):
    schema_version: Literal[1] = 1
    offerings: list[NodeOffering]


class MarketSnapshot(_Strict):
    """The market a running controller plans in, as a market source publishes it (`coral serve --market`): the
    offerings (prices, instance types, regions) and the nodes available per region and config; a part left out
    keeps the scenario's."""

    schema_version: Literal[1] = 1
    offerings: list[NodeOffering] | None = Field(default=None, description="replace the market's offerings")
    availability: dict[str, dict[str, int]] | None = Field(
        default=None, description="{region: {config: nodes}}; unlisted pairs have none")

    @model_validator(mode="after")
    def _counts(self) -> MarketSnapshot:
        for region, cfgs in (self.availability or {}).items():
            for cfg, n in cfgs.items():
                if n < 0:
                    raise ValueError(f"availability.{region}.{cfg}: count must be >= 0")
        return self


class ModelArch(_Strict):
    """Transformer architecture, with field names following Hugging Face ``config.json``."""

    name: str = Field(min_length=1)
    hf_id: str = ""
    model_type: str = Field(default="", description="the config's architecture (phi3, qwen3_moe, gpt_oss, ...)")
    num_hidden_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    intermediate_size: int = Field(gt=0, description="dense MLP width (unused for pure-MoE layers)")
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int | None = Field(
        default=None, gt=0, description="context length in tokens (prompt + output; config.json, as `source` cites); "
        "None: unknown (the gateway bounds prompts by its global `max_prompt_tokens`)")
    tie_word_embeddings: bool = False
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_intermediate_size: int | None = Field(default=None, gt=0)
    sliding_window: int | None = Field(default=None, gt=0)
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    expert_weight_bits: float = Field(default=16.0, gt=0, le=32, description="e.g. 4.25 for MXFP4 experts")
    source: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> ModelArch:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError("num_experts_per_tok must be in 1..num_experts for a MoE model")
        if self.num_experts and self.moe_intermediate_size is None:
            raise ValueError("moe_intermediate_size is required for a MoE model")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("layer_types must have num_hidden_layers entries")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("sliding_window is required when layer_types has sliding_attention")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def hybrid_attention(self) -> bool:
        return self.layer_types is not None and "sliding_attention" in self.layer_types


class ModelCatalog(_Strict):
    schema_version: Literal[1] = 1
    models: list[ModelArch]


class RequestClass(_Strict):
    """A request-length class of one model's workload: its share of the requests and their mean lengths."""

    share: float = Field(gt=0, le=1, description="fraction of the model's requests")
    mean_input_tokens: float = Field(gt=0)
    mean_output_tokens: float = Field(gt=0)
    name: Annotated[str, AfterValidator(printable)] = Field(default="", max_length=128)
    max_input_tokens: float | None = Field(
        default=None, gt=0, description="longest prompt routed to this class (default: halfway to the next class's "
        "mean; the longest class takes the rest)")


class ScenarioModel(_Strict):
    """A model served in a scenario, with its SLOs and workload."""

    model: str
    prefill_slo_ms: float = Field(gt=0, le=600_000, description="time-to-first-token SLO")
    decode_slo_ms: float = Field(gt=0, le=60_000, description="time-per-output-token SLO")
    request_rate: float = Field(ge=0, le=100_000, description="mean requests/s")
    mean_input_tokens: float = Field(gt=0, le=1 << 20)
    mean_output_tokens: float = Field(gt=0, le=1 << 20)
    trace: str = Field(default="synthetic", description="trace name used by the simulator")
    slo_attainment: float = Field(
        default=0.9, gt=0, le=0.999,
        description="fraction of the model's requests that must meet both its TTFT and TPOT SLOs; plans are "
        "sized and checked for it (coral.planning)")
    priority: float = Field(default=1.0, gt=0)
    request_classes: Literal["auto", "off"] | Annotated[
        list[RequestClass], Field(max_length=MAX_REQUEST_CLASSES)
    ] = Field(
        default="off",
        description="request-length classes planned separately (a template's capacity is shared by classes, each "
        "rated at its own lengths): 'off' (default) = one class with the mean lengths, 'auto' = prompt-length "
        "quantile classes of the trace when its spread is wide (see coral.allocation.classes), or an explicit list",
    )

    @field_validator("request_classes")
    @classmethod
    def _shares(cls, classes: str | list[RequestClass]) -> str | list[RequestClass]:
        if isinstance(classes, list):
            if not classes:
                raise ValueError("request_classes: give at least one class, or 'auto' / 'off'")
            total = sum(c.share for c in classes)
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"request_classes: shares must sum to 1, not {total:.6g}")
        return classes


class AvailabilityHeadroom(_Strict):
    """Availability derived from demand: enough nodes of every offered config for `factor` x the demand."""

    mode: Literal["headroom"] = "headroom"
    factor: float = Field(gt=0, le=100)


class AvailabilityStep(_Strict):
    """From `at_s` on, the listed (region, config) node counts and prices."""

    at_s: float = Field(ge=0, description="from this simulated time on")
    counts: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="{region: {config: nodes}}; unlisted pairs keep their count")
    prices: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="{region: {config: $/node-hour}}; unlisted pairs keep their price (the "
        "offerings' at first)")


class AvailabilitySchedule(_Strict):
    """Piecewise-constant market: availability and prices. Each step overrides the listed (region, config)
    counts and prices from its `at_s` on; before the first step, and for (region, config)s no step lists, the
    scenario's own availability is in force (its table, the market's counts, or unlimited)."""

    schema_version: Literal[1] = 1
    steps: list[AvailabilityStep] = Field(min_length=1, max_length=MAX_SCHEDULE_STEPS)

    @model_validator(mode="after")
    def _sorted(self) -> AvailabilitySchedule:
        times = [s.at_s for s in self.steps]
        if times != sorted(times):
            raise ValueError("steps: at_s must be non-decreasing")
        for i, s in enumerate(self.steps):
            for region, cfgs in s.counts.items():
                for cfg, n in cfgs.items():
                    if n < 0:
                        raise ValueError(f"steps.{i}.counts.{region}.{cfg}: count must be >= 0")
            for region, prices in s.prices.items():
                for cfg, price in prices.items():
                    if not price > 0:
                        raise ValueError(f"steps.{i}.prices.{region}.{cfg}: price must be > 0")
        return self

    def at(self, t: float) -> dict[str, dict[str, int]]:
        """Counts in force at time t."""
        return self._in_force(t, "counts")

    def prices_at(self, t: float) -> dict[str, dict[str, float]]:
        """Price overrides in force at time t ({} when no step has set any)."""
        return self._in_force(t, "prices")

    def _in_force(self, t: float, table: Literal["counts", "prices"]) -> dict[str, dict[str, Any]]:
        """{region: {config: value}} of one of the steps' tables, each step overriding the ones before it."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.steps:
            if s.at_s > t:
                break
            for region, values in getattr(s, table).items():
                out.setdefault(region, {}).update(values)
        return out


class TargetUtilization(_Strict):
    """An explicit override of burst-aware sizing, per phase: planned capacity = mean demand / this; 1 plans for
    the mean exactly, as the paper does. Unset (the default), a phase's capacity comes from each model's traffic
    and SLO-attainment target (coral.allocation.demand)."""

    prefill: float | None = Field(default=None, gt=0, le=1)
    decode: float | None = Field(default=None, gt=0, le=1)

    def of(self, phase: str) -> float | None:
        return self.prefill if phase == "prefill" else self.decode


class Scenario(_Strict):
    schema_version: Literal[1] = 1
    name: SafeName = Field(description="the scenario's name: plans, files and deployments are named after it")
    description: str = Field(default="", max_length=2000)
    regions: list[str] = Field(min_length=1, max_length=MAX_SCENARIO_REGIONS)
    offerings: str | None = Field(
        default=None, description="offerings file (the schema of coral/data/offerings.yaml) replacing the shipped "
        "market for this scenario: prices, instance types, regions; relative to the scenario file")
    configs: list[str] = Field(min_length=1, max_length=MAX_SCENARIO_CONFIGS,
                               description="node configs, e.g. '2xL40S'")
    models: list[ScenarioModel] = Field(min_length=1, max_length=MAX_SCENARIO_MODELS)
    availability: dict[str, dict[str, int]] | AvailabilityHeadroom | Literal["market", "unlimited"] = Field(
        description="explicit node counts per region and config; 'market': the offerings' `available` counts "
        "(an offering without one: unlimited); 'unlimited'; or a headroom rule (derived from the cheapest "
        "unlimited Coral plan, so it favours Coral's shapes: for experiments)"
    )
    availability_schedule: AvailabilitySchedule | None = Field(
        default=None, description="availability over simulated time; overrides `availability` from each step on"
    )
    target_utilization: TargetUtilization = Field(
        default_factory=lambda: TargetUtilization(),
        description="override: plan capacity = mean demand / this, per phase (unset: burst-aware capacity from "
        "each model's trace and slo_attainment)",
    )
    trace_scaling: Literal["superpose", "compress"] = Field(
        default="superpose",
        description="how a trace reaches the model's rate: overlay independent segments (superpose) or "
        "compress time (compress, which keeps every burst of the trace, made denser)")
    n_max: int = Field(default=6, ge=1, le=8)
    rho: float = Field(default=12.0, gt=1)
    init_penalty_k: float = Field(default=0.1, ge=0, description="node init time / adjustment interval")
    epoch_minutes: float = Field(default=6.0, gt=0, le=MAX_EPOCH_MINUTES)
    epochs: int = Field(default=5, ge=1, le=MAX_EPOCHS)

    @field_validator("regions")
    @classmethod
    def _unique_regions(cls, regions: list[str]) -> list[str]:
        if len(set(regions)) != len(regions):
            raise ValueError("regions must be unique")
        return regions

    @field_validator("configs")
    @classmethod
    def _config_names(cls, configs: list[str]) -> list[str]:
        for c in configs:
            parse_config_name(c)
        if len(set(configs)) != len(configs):
            raise ValueError("configs must be unique")
        return configs

    @model_validator(mode="after")
    def _availability_keys(self) -> Scenario:
        if isinstance(self.availability, dict):
            for region, counts in self.availability.items():
                if region not in self.regions:
                    raise ValueError(f"availability: region {region!r} is not in regions"
                                     f"{did_you_mean(region, self.regions)}")
                for cfg, n in counts.items():
                    if cfg not in self.configs:
                        raise ValueError(f"availability.{region}: config {cfg!r} is not in configs"
                                         f"{did_you_mean(cfg, self.configs)}")
                    if n < 0:
                        raise ValueError(f"availability.{region}.{cfg}: count must be >= 0")
        if self.availability_schedule is not None:
            for i, step in enumerate(self.availability_schedule.steps):
                for region, counts in step.counts.items():
                    if region not in self.regions:
                        raise ValueError(f"availability_schedule.steps.{i}: region {region!r} is not in regions"
                                         f"{did_you_mean(region, self.regions)}")
                    bad = sorted(set(counts) - set(self.configs))
                    if bad:
                        raise ValueError(f"availability_schedule.steps.{i}.{region}: configs {bad} not in configs")
        names = [m.model for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("models: each model may appear once")
        return self

    @model_validator(mode="after")
    def _size(self) -> Scenario:
        """Refuse a scenario whose template library or simulated run would be out of all proportion."""
        sets = math.comb(len(self.configs) + self.n_max, self.n_max) - 1
        if sets > MAX_NODE_SETS:
            raise ValueError(f"configs, n_max: {len(self.configs)} configs with n_max {self.n_max} make {sets:,} node "
                             f"sets per model and phase, more than the {MAX_NODE_SETS:,} allowed: list fewer configs "
                             "or lower n_max")
        rate = sum(m.request_rate for m in self.models)
        requests = rate * self.epochs * self.epoch_minutes * 60.0
        if requests > MAX_RUN_REQUESTS:
            raise ValueError(f"models.request_rate, epochs, epoch_minutes: a run of {self.epochs} epochs of "
                             f"{self.epoch_minutes:g} minutes at {rate:g} requests/s simulates {requests:,.0f} "
                             f"requests, more than the {MAX_RUN_REQUESTS:,} allowed")
        return self


def config_name(gpu: str, count: int) -> str:
    return f"{count}x{gpu}"


def parse_config_name(name: str) -> tuple[str, int]:
    """'4xL40S' -> ('L40S', 4)."""
    head, sep, gpu = name.partition("x")
    if not sep or not head.isdigit() or not gpu or int(head) not in (1, 2, 4, 8):
        raise ValueError(f"config {name!r} must look like '<1|2|4|8>x<GPU>', e.g. '2xL40S'")
    return gpu, int(head)
