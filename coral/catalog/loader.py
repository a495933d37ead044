"""Load catalogs and scenarios from package data or user files, with errors that name the field."""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from coral.catalog.schema import (
    GpuCatalog,
    GpuSpec,
    ModelArch,
    ModelCatalog,
    NodeOffering,
    OfferingCatalog,
    Scenario,
    parse_config_name,
    shown,
)
from coral.catalog.suggest import did_you_mean

T = TypeVar("T", bound=BaseModel)


class CoralInputError(ValueError):
    """Bad user input: the message names the file, the field and the reason."""


MAX_INPUT_BYTES_ENV = "CORAL_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 64 << 20
"""Bytes an input file (plan, scenario, offerings, catalogue, market, key file) may hold unless
$CORAL_MAX_INPUT_BYTES says otherwise: far above any plan Coral writes (a plan at the controller's caps is a few
MB), far below what would fill memory."""

_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character "
               "device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def max_input_bytes() -> int:
    """The cap on an input file's size: $CORAL_MAX_INPUT_BYTES (bytes, > 0), else DEFAULT_MAX_INPUT_BYTES."""
    raw = os.environ.get(MAX_INPUT_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_INPUT_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise CoralInputError(f"${MAX_INPUT_BYTES_ENV}: must be a whole number of bytes above 0, not {raw!r}")
    return value


def _not_regular(path: Path, mode: int) -> str | None:
    """Why a file of `mode` is no input file (a folder, a FIFO, a device, a socket), else None."""
    for test, kind in _FILE_KINDS:
        if test(mode):
            return f"{path}: is {kind}, not a {'file' if kind == 'a folder' else 'regular file'}"
    return None if stat.S_ISREG(mode) else f"{path}: not a regular file"


def read_input_bytes(path: str | Path) -> bytes:
    """The bytes of the input file at `path`: a regular file (a folder, FIFO, device or socket is refused, and is
    never opened for reading but without blocking) of at most `max_input_bytes()`; CoralInputError naming it
    otherwise, and how to raise the cap."""
    path = Path(path)
    cap = max_input_bytes()
    try:
        if (why := _not_regular(path, os.stat(path).st_mode)) is not None:
            raise CoralInputError(why)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in cannot block the open
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if (why := _not_regular(path, st.st_mode)) is not None:  # what was opened, not only what was looked at
            raise CoralInputError(why)
        too_big = (f"{path}: over the {cap:,}-byte limit on input files (set ${MAX_INPUT_BYTES_ENV} to a larger "
                   "number of bytes to read it)")
        if st.st_size > cap:
            raise CoralInputError(too_big.replace(": over", f": {st.st_size:,} bytes, over"))
        os.set_blocking(fd, True)
        data = f.read(cap + 1)  # a file still growing stops at the cap too
    if len(data) > cap:
        raise CoralInputError(too_big)
    return data


def read_input_text(path: str | Path) -> str:
    """The UTF-8 text of the input file at `path` (`read_input_bytes`)."""
    data = read_input_bytes(path)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise CoralInputError(f"{path}: not UTF-8 text (byte {exc.start})") from exc


def _read_structured(path: Path) -> Any:
    return parse_structured(read_input_text(path), str(path), "json" if path.suffix == ".json" else "yaml")


class NotStrictJson(ValueError):
    """A JSON document with a number that is not finite (NaN, Infinity, or one that overflows to infinity) or a
    string that is not Unicode text (a lone surrogate escape): the message names where."""


@dataclass(frozen=True)
class _Unfinite:
    """What the strict JSON parser makes of a number that is not finite, until `_check_strict` names its place."""

    text: str


def _float_or_unfinite(text: str) -> float | _Unfinite:
    value = float(text)
    return value if math.isfinite(value) else _Unfinite(text)


def _strict_problem(value: Any, where: str) -> str | None:
    """Where in a parsed document the first non-finite number or non-Unicode string is, and what it is."""
    if isinstance(value, _Unfinite):
        return f"{where or '(top level)'}: {value.text[:40]} is not a finite number"
    if isinstance(value, str):
        return None if _unicode(value) else f"{where or '(top level)'}: a string with a lone surrogate (not Unicode text)"
    items: list[tuple[Any, Any]] = []
    if isinstance(value, dict):
        for key in value:
            if not _unicode(key):
                return f"{where or '(top level)'}: a key with a lone surrogate (not Unicode text)"
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    for key, item in items:
        if (found := _strict_problem(item, f"{where}.{key}" if where else str(key))) is not None:
            return found
    return None


def _unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def strict_json_loads(text: str | bytes) -> Any:
    """`text` parsed as strict JSON: ValueError (json.JSONDecodeError) when it is not JSON, NotStrictJson naming
    the field of a number that is not finite (`NaN`, `Infinity`, `1e400`) or of a string that is not Unicode text,
    which Python's json module lets through and no later writer can write back."""
    doc = json.loads(text, parse_constant=_Unfinite, parse_float=_float_or_unfinite)
    if (problem := _strict_problem(doc, "")) is not None:
        raise NotStrictJson(problem + " (JSON numbers must be finite, strings Unicode text)")
    return doc


def parse_structured(text: str, source: str, syntax: Literal["yaml", "json"] = "yaml") -> Any:
    """`text` parsed as YAML or JSON (strict: `strict_json_loads`); a syntax error is a CoralInputError naming
    `source`, the line and the column."""
    try:
        return strict_json_loads(text) if syntax == "json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise CoralInputError(f"{source}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except NotStrictJson as exc:
        raise CoralInputError(f"{source}: {exc}") from None
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise CoralInputError(f"{source}: malformed JSON: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        raise CoralInputError(f"{source}: malformed YAML{_yaml_where(exc)}") from None
    except yaml.YAMLError as exc:
        raise CoralInputError(f"{source}: malformed YAML: {exc}") from None
    except RecursionError:
        raise CoralInputError(f"{source}: nested too deeply") from None


def _yaml_where(exc: yaml.MarkedYAMLError) -> str:
    """' at line L, column C: problem (while ... at line L, column C)' of a YAML syntax error, without PyYAML's
    '"<unicode string>"' for the file."""
    def at(mark: yaml.Mark | None) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    out = f"{at(exc.problem_mark)}: {exc.problem or 'syntax error'}"
    if exc.context:
        out += f" ({exc.context}{at(exc.context_mark)})"
    return out


DOCUMENT_KINDS: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("Plan", "a plan", frozenset({"scenario", "method", "instances", "serving", "solve"})),
    ("Scenario", "a scenario", frozenset({"name", "regions", "configs", "models", "availability"})),
    ("OfferingCatalog", "an offerings file", frozenset({"offerings"})),
    ("ModelCatalog", "a model catalogue", frozenset({"models"})),
    ("GpuCatalog", "a GPU catalogue", frozenset({"gpus"})),
    ("ModelArch", "a model architecture or Hugging Face config.json", frozenset({"num_hidden_layers", "hidden_size"})),
    ("SimResult", "a simulation result", frozenset({"overall", "models", "epochs", "cost_timeline"})),
    ("", "a `coral run` summary.json", frozenset({"planned_cost_per_hour", "slo_attainment"})),
    ("PerfParams", "a perf-model parameters file", frozenset({"compute_efficiency", "memory_efficiency"})),
    ("EndpointsFile", "an endpoints file", frozenset({"endpoints"})),
    ("AvailabilitySchedule", "an availability schedule", frozenset({"steps"})),
)
"""(schema class name, '' for a document no schema reads; what its documents are called; keys that mark one): how
a message names the document a file looks like when it is not the one expected."""


def document_kind(schema: type[BaseModel]) -> str:
    """What a document of `schema` is called in messages, with its article: 'a plan', 'an offerings file'."""
    for name, kind, _ in DOCUMENT_KINDS:
        if name == schema.__name__:
            return kind
    words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", schema.__name__).lower()
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


def _looks_like(data: Mapping[str, Any], not_kind: str) -> str | None:
    """What `data` looks like (the kind whose marking keys it has, the most of them), other than `not_kind`."""
    fits = [(len(keys), kind) for _, kind, keys in DOCUMENT_KINDS if kind != not_kind and keys <= data.keys()]
    return max(fits, key=lambda f: f[0])[1] if fits else None


def not_the_document(schema: type[BaseModel], data: Any, source: str) -> str | None:
    """A one-line message when `data` is plainly not a `schema` document (not a mapping, or it lacks more than half
    of the schema's required fields), saying what it looks like; None when it is one with some bad fields, whose
    errors are worth listing one by one."""
    kind = document_kind(schema)
    if data is None:
        return f"{source} is not {kind} (it is empty)"
    if not isinstance(data, Mapping):
        return f"{source} is not {kind} (it holds a {type(data).__name__}, not a mapping of fields)"
    required = [name for name, field in schema.model_fields.items() if field.is_required()]
    missing = [name for name in required if name not in data]
    if 2 * len(missing) <= len(required):
        return None
    has = (f"none of {', '.join(required)}" if len(missing) == len(required)
           else f"{len(required) - len(missing)} of its {len(required)} required fields; missing: {', '.join(missing)}")
    looks = _looks_like(data, kind)
    return f"{source} is not {kind} (it has {has}{f'; it looks like {looks}' if looks else ''})"


def format_validation_error(source: str, exc: ValidationError) -> str:
    """'source: invalid input' and a 'field: reason (got value)' line per error of `exc`."""
    lines = [f"{source}: invalid input"]
    for err in exc.errors():
        where = ".".join(shown(str(p)) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        got_text = f" (got {got!r:.80})" if isinstance(got, int | float | str) else ""
        lines.append(f"  {where}: {err['msg']}{got_text}")
    return "\n".join(lines)


def validate(schema: type[T], data: Any, source: str) -> T:
    """`data` as a `schema` document; CoralInputError naming `source`: what the document looks like when it is
    plainly another kind, else each bad field and why."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise CoralInputError(not_the_document(schema, data, source) or format_validation_error(source, exc)) from exc


def load_file(schema: type[T], path: str | Path) -> T:
    path = Path(path)
    return validate(schema, _read_structured(path), str(path))


def data_path(*parts: str) -> Path:
    return Path(str(resources.files("coral").joinpath("data", *parts)))


@dataclass(frozen=True)
class NodeConfig:
    """A node shape: `count` GPUs of one type (e.g. 2xL40S), independent of region."""

    name: str
    gpu: GpuSpec
    count: int
    nic_gbps: float

    @property
    def memory_gb(self) -> float:
        return self.gpu.memory_gb * self.count

    @property
    def nic_bytes_s(self) -> float:
        """Network bandwidth in bytes/s (what KV hand-offs are charged at)."""
        return self.nic_gbps * 1e9 / 8


@dataclass(frozen=True)
class Catalog:
    """GPU types, rentable offerings and model architectures."""

    gpus: dict[str, GpuSpec]
    offerings: tuple[NodeOffering, ...]
    models: dict[str, ModelArch]

    def gpu(self, name: str) -> GpuSpec:
        try:
            return self.gpus[name]
        except KeyError:
            raise CoralInputError(f"unknown GPU {name!r}{did_you_mean(name, self.gpus)}; known: "
                                  f"{', '.join(sorted(self.gpus))}") from None

    def model(self, name: str) -> ModelArch:
        try:
            return self.models[name]
        except KeyError:
            raise CoralInputError(f"unknown model {name!r}{did_you_mean(name, self.models)}; known: "
                                  f"{', '.join(sorted(self.models))}") from None

    def node_config(self, name: str) -> NodeConfig:
        try:
            gpu_name, count = parse_config_name(name)
        except ValueError as exc:
            raise CoralInputError(f"{exc}{did_you_mean(name, self.configs())}") from None
        gpu = self.gpu(gpu_name)
        nics = [o.nic_gbps for o in self.offerings if o.config == name]
        return NodeConfig(name=name, gpu=gpu, count=count, nic_gbps=min(nics) if nics else 25.0)

    def prices(self, region: str) -> dict[str, float]:
        """Cheapest on-demand $/node-hour per config offered in `region`."""
        out: dict[str, float] = {}
        for o in self.offerings:
            if o.region == region:
                out[o.config] = min(out.get(o.config, o.price_per_hour), o.price_per_hour)
        return out

    def regions(self) -> list[str]:
        return sorted({o.region for o in self.offerings})

    def configs(self) -> list[str]:
        """Node configs some offering sells, e.g. '2xL40S'."""
        return sorted({o.config for o in self.offerings})

    def with_models(self, extra: list[ModelArch]) -> Catalog:
        models = dict(self.models)
        models.update({m.name: m for m in extra})
        return Catalog(gpus=self.gpus, offerings=self.offerings, models=models)

    def with_offerings(self, offerings: list[NodeOffering]) -> Catalog:
        return Catalog(gpus=self.gpus, offerings=tuple(offerings), models=self.models)

    def with_prices(self, prices: Mapping[str, Mapping[str, float]]) -> Catalog:
        """This catalog with the $/node-hour of the offerings of {region: {config: price}} replaced; a pair
        that no offering sells is an error."""
        sold = {(o.region, o.config) for o in self.offerings}
        for region, cfgs in prices.items():
            for cfg in cfgs:
                if (region, cfg) not in sold:
                    raise CoralInputError(f"prices.{region}.{cfg}: no offering sells {cfg} in {region}")
        return self.with_offerings([o.model_copy(update={"price_per_hour": float(prices[o.region][o.config])})
                                    if o.config in prices.get(o.region, {}) else o for o in self.offerings])


def user_models_dir() -> Path:
    """Where `coral models add` keeps user models: $CORAL_HOME/models (default ~/.coral/models)."""
    return Path(os.environ.get("CORAL_HOME", Path.home() / ".coral")) / "models"


def user_models() -> list[ModelArch]:
    folder = user_models_dir()
    if not folder.is_dir():
        return []
    return [load_file(ModelArch, p) for p in sorted(folder.glob("*.yaml"))]


@cache
def builtin_catalog() -> Catalog:
    """Packaged GPUs, offerings and models, plus the user's models from `user_models_dir()`."""
    gpus = load_file(GpuCatalog, data_path("gpus.yaml"))
    offers = load_file(OfferingCatalog, data_path("offerings.yaml"))
    models = load_file(ModelCatalog, data_path("models.yaml"))
    cat = Catalog(
        gpus={g.name: g for g in gpus.gpus},
        offerings=tuple(offers.offerings),
        models={m.name: m for m in [*models.models, *user_models()]},
    )
    for o in cat.offerings:
        cat.gpu(o.gpu)
    return cat


def builtin_scenarios() -> list[str]:
    return sorted(p.stem for p in data_path("scenarios").iterdir() if p.suffix == ".yaml")


SCENARIO_SUFFIXES = (".yaml", ".yml", ".json")


def scenario_path(name_or_path: str | Path) -> Path:
    """The file a scenario argument names. A built-in scenario's name is the built-in one, even where a file or
    folder of that name is here (which stderr says once, with how to read the local one: `./NAME`); an argument
    that looks like a path (a slash, or a .yaml/.yml/.json suffix) is a path."""
    arg = str(name_or_path)
    local = Path(arg)
    builtins = builtin_scenarios()
    looks_like_path = "/" in arg or os.sep in arg or arg.endswith(SCENARIO_SUFFIXES)
    if arg in builtins and not looks_like_path:
        if local.exists():
            _say_builtin_shadows(arg, local.resolve())
        return data_path("scenarios", f"{arg}.yaml")
    if local.is_dir():
        raise CoralInputError(f"scenario {arg!r}: {local} is a folder, not a scenario file")
    if not local.exists():
        if looks_like_path:
            raise CoralInputError(f"scenario {arg!r}: no such file")
        raise CoralInputError(f"scenario {arg!r}: no such file and not a built-in scenario"
                              f"{did_you_mean(arg, builtins)}; built-in: {', '.join(builtins)}")
    return local


@cache
def _say_builtin_shadows(name: str, local: Path) -> None:
    """Say on stderr (once per process and local path) that the built-in scenario `name` is read, not `local`."""
    what = "folder" if local.is_dir() else "file"
    print(f"scenario {name}: using the built-in scenario, not the {what} ./{name} here (give ./{name} to use that)",
          file=sys.stderr)


def load_scenario(name_or_path: str | Path, catalog: Catalog | None = None) -> Scenario:
    """Load a built-in scenario by name or a scenario file (see `scenario_path`), and check it against the catalog."""
    path = scenario_path(name_or_path)
    scenario = load_file(Scenario, path)
    if scenario.offerings is not None:  # resolved against the scenario's folder, so later readers find it
        scenario = scenario.model_copy(update={"offerings": str((path.parent / scenario.offerings).resolve())})
    check_scenario(scenario, catalog or market_catalog(scenario), str(path))
    return scenario


def scenario_and_market(scenario: str | Path, offerings: str | Path | None = None) -> tuple[Scenario, Catalog]:
    """The scenario, checked against the market it plans in (`offerings` when given, which then becomes the
    scenario's `offerings` file, so that its later readers plan in it too), and that market."""
    if offerings is None:
        sc = load_scenario(scenario)
        return sc, market_catalog(sc)
    market = load_offerings(offerings)
    return load_scenario(scenario, market).model_copy(update={"offerings": str(Path(offerings).resolve())}), market


def load_offerings(path: str | Path, base: Catalog | None = None) -> Catalog:
    """`base` (default: the built-in catalog) with its offerings replaced by those of the file at `path`,
    validated like every input file (schema, and every offering's GPU known)."""
    return offerings_catalog(load_file(OfferingCatalog, path).offerings, str(path), base)


def offerings_catalog(offerings: list[NodeOffering], source: str, base: Catalog | None = None) -> Catalog:
    """`base` (default: the built-in catalog) with its offerings replaced by `offerings` (read from `source`),
    every offering's GPU known."""
    base = base or builtin_catalog()
    for i, o in enumerate(offerings):
        if o.gpu not in base.gpus:
            raise CoralInputError(f"{source}: offerings.{i}.gpu: unknown GPU {o.gpu!r}{did_you_mean(o.gpu, base.gpus)}; "
                                  f"known: {', '.join(sorted(base.gpus))}")
    return base.with_offerings(list(offerings))


def check_region_table(table: Mapping[str, Mapping[str, Any]], scenario: Scenario, where: str) -> None:
    """Every region and config of a {region: {config: value}} table (at `where` of an input) in the scenario."""
    for region, cfgs in table.items():
        if region not in scenario.regions:
            raise CoralInputError(f"{where}: region {region!r} is not in the scenario"
                                  f"{did_you_mean(region, scenario.regions)}")
        for cfg in cfgs:
            if cfg not in scenario.configs:
                raise CoralInputError(f"{where}.{region}: config {cfg!r} not in scenario"
                                      f"{did_you_mean(cfg, scenario.configs)}")


def market_catalog(scenario: Scenario, offerings: str | Path | None = None) -> Catalog:
    """The catalog a scenario plans with: the built-in one with the offerings of `offerings` (e.g.
    `--offerings FILE`), else of the scenario's `offerings` file, else the shipped offerings."""
    path = offerings if offerings is not None else scenario.offerings
    return builtin_catalog() if path is None else load_offerings(path)


def check_scenario(scenario: Scenario, catalog: Catalog, source: str) -> None:
    for i, m in enumerate(scenario.models):
        if m.model not in catalog.models:
            raise CoralInputError(f"{source}: models.{i}.model: unknown model {m.model!r}"
                                  f"{did_you_mean(m.model, catalog.models)}")
    for c in scenario.configs:
        gpu, _ = parse_config_name(c)
        if gpu not in catalog.gpus:
            raise CoralInputError(f"{source}: configs: unknown GPU {gpu!r} in {c!r}{did_you_mean(gpu, catalog.gpus)}")
    for r in scenario.regions:
        if not catalog.prices(r):
            raise CoralInputError(f"{source}: regions: no offerings known for region {r!r}"
                                  f"{did_you_mean(r, catalog.regions())}")


def model_from_hf_config(name: str, config: dict[str, Any], **overrides: Any) -> ModelArch:
    """Build a ModelArch from the fields of a Hugging Face ``config.json``."""
    cfg = dict(config.get("text_config", config))
    fields = {
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "num_attention_heads": cfg.get("num_attention_heads"),
        "num_key_value_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
        "head_dim": cfg.get("head_dim"),
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg.get("vocab_size"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "num_experts": cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 0)) or 0,
        "moe_intermediate_size": cfg.get("moe_intermediate_size")
        or (cfg.get("intermediate_size") if cfg.get("num_local_experts") else None),
        "sliding_window": cfg.get("sliding_window") if cfg.get("layer_types") else None,
        "layer_types": cfg.get("layer_types"),
        "dtype": "float16" if cfg.get("torch_dtype") == "float16" else "bfloat16",
        "hf_id": cfg.get("_name_or_path", ""),
        "model_type": cfg.get("model_type", ""),
    }
    fields.update(overrides)
    return validate(ModelArch, {"name": name, **fields}, f"config.json of {name}")
