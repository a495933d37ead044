"""MkDocs hooks: the generated reference pages.

A page holding a marker line `<!-- generated: NAME -->` gets it replaced, at build time, by the markdown of
`GENERATORS[NAME]`: every command and option of the `coral` CLI (from the typer app), every input file's schema
(from the pydantic models of coral.catalog.schema and coral.perf.measured) and every output file's fields (from the
pydantic models the outputs are dumped from, and `SUMMARY_FIELDS` for summary.json). Nothing in those pages is
copied by hand; tests/test_docs.py builds the same markdown in-process and checks that every command, option and
field has an entry.

Registered in mkdocs.yml (`hooks: [docs/hooks.py]`)."""

from __future__ import annotations

import html
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)

# ----------------------------------------------------------------------------------------------------------------
# CLI


def cli_command() -> Any:
    """The click command tree of the `coral` typer app."""
    import typer.main

    from coral.cli.main import app

    return typer.main.get_command(app)


def walk_commands(command: Any, path: tuple[str, ...] = ("coral",)) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(name path, click command) of `command` and every subcommand, depth first, sorted by name."""
    yield path, command
    for name in sorted(getattr(command, "commands", {}) or {}):
        yield from walk_commands(command.commands[name], (*path, name))


def _cell(text: str) -> str:
    """`text` safe inside a markdown table cell (one line, no pipes, no HTML)."""
    text = html.escape(" ".join(str(text).split()), quote=False)
    return text.replace("|", "\\|")


def _strip_markup(text: str) -> str:
    return re.sub(r"\[/?(bold|red|green|yellow|dim|italic)\]", "", text or "")


def _param_row(param: Any, ctx: Any) -> str:
    is_flag = bool(getattr(param, "is_flag", False))
    if param.param_type_name == "argument":
        names = f"`{(param.metavar or param.name or '').upper()}`"
        kind = "argument"
    else:
        names = ", ".join(f"`{f}`" for f in [*param.opts, *param.secondary_opts])
        kind = "flag" if is_flag and not param.secondary_opts else "option"
    type_name = ""
    if not is_flag:
        shown_type = param.display_type(ctx) if callable(param.display_type) else str(param.display_type)
        type_name = _cell(shown_type.strip("<>"))
    default = param.default
    shown = ""
    if is_flag and param.secondary_opts:
        shown = f"`{param.opts[0] if default else param.secondary_opts[0]}`"
    elif default not in (None, (), [], False, "") and not callable(default) and not is_flag:
        shown = f"`{_cell(str(default))}`"
    help_text = _strip_markup(getattr(param, "help", "") or "")
    if getattr(param, "envvar", None):
        help_text += f" (env var `{param.envvar}`)"
    return f"| {names} | {kind} | {type_name} | {shown} | {'yes' if param.required else ''} | {_cell(help_text)} |"


def cli_reference() -> str:
    """Markdown of every `coral` command: its usage, help text, arguments and options."""
    root = cli_command()
    out = ["Generated from the typer app (`coral.cli.main.app`) when the docs are built: every command, argument and "
           "option, with its type, default and help text, as `coral COMMAND --help` prints them.", ""]
    for path, cmd in walk_commands(root):
        name = " ".join(path)
        out.append(f"{'#' * min(len(path) + 1, 4)} `{name}`")
        out.append("")
        ctx = cmd.context_class(cmd, info_name=name)
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        out += ["```text", f"{name} {usage}".rstrip(), "```", ""]
        doc = _strip_markup(inspect.cleandoc(cmd.help or ""))
        if doc:
            out += [doc, ""]
        subs = getattr(cmd, "commands", None)
        if subs:
            out += ["| command | what it does |", "|---|---|"]
            for sub in sorted(subs):
                short = _strip_markup(subs[sub].get_short_help_str(limit=300))
                out.append(f"| `{name} {sub}` | {_cell(short)} |")
            out.append("")
        params = [p for p in cmd.params if not getattr(p, "hidden", False)]
        if params:
            out += ["| name | kind | type | default | required | help |", "|---|---|---|---|---|---|"]
            out += [_param_row(p, ctx) for p in params]
            out.append("")
        if cmd.epilog:
            out += [_strip_markup(cmd.epilog), ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# pydantic models -> field tables


def _type_of(schema: dict[str, Any]) -> str:
    """A JSON-schema fragment as a short type: `int`, `list[PlanStage]`, `"a" | "b"`, ..."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "const" in schema:
        return repr(schema["const"]).replace("'", '"')
    if "enum" in schema:
        return " \\| ".join(repr(v).replace("'", '"') for v in schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " \\| ".join(_type_of(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        if isinstance(items, dict):
            return f"list[{_type_of(items)}]"
        if "prefixItems" in schema:
            return "[" + ", ".join(_type_of(s) for s in schema["prefixItems"]) + "]"
        return "list"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return f"{{str: {_type_of(extra)}}}"
        return "object"
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
    if isinstance(kind, list):
        return " \\| ".join(names.get(k, k) for k in kind)
    return names.get(kind, str(kind or "any"))


_BOUNDS = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"),
           ("minLength", "length ≥"), ("maxLength", "length ≤"), ("minItems", "items ≥"), ("maxItems", "items ≤"),
           ("pattern", "matches"))


def _bounds(schema: dict[str, Any]) -> str:
    parts = []
    for frag in [schema, *schema.get("anyOf", [])]:
        for key, word in _BOUNDS:
            if key in frag:
                value = frag[key]
                parts.append(f"{word} `{value}`" if key == "pattern" else f"{word} {value}")
    return ", ".join(dict.fromkeys(parts))


def model_tables(model: Any, mode: str = "validation", heading: int = 3, seen: set[str] | None = None) -> str:
    """Markdown tables of `model`'s fields and of every model it nests (its JSON schema's `$defs`), each once."""
    import json

    schema = model.model_json_schema(mode=mode)
    defs = schema.get("$defs", {})
    seen = set() if seen is None else seen
    out: list[str] = []
    for name, sch in [(model.__name__, schema), *sorted(defs.items())]:
        if name in seen:
            continue
        seen.add(name)
        out += [f"{'#' * heading} `{name}`", ""]
        if sch.get("description"):
            out += [" ".join(sch["description"].split()), ""]
        props = sch.get("properties", {})
        if not props:
            out += ["(no fields)", ""]
            continue
        required = set(sch.get("required", []))
        out += ["| field | type | required | default | constraints | description |", "|---|---|---|---|---|---|"]
        for field, fs in props.items():
            default = f"`{_cell(json.dumps(fs['default']))}`" if "default" in fs else ""
            out.append(f"| `{field}` | {_cell(_type_of(fs)).replace(chr(92) + chr(92), chr(92))} | "
                       f"{'yes' if field in required else ''} | {default} | {_cell(_bounds(fs))} | "
                       f"{_cell(fs.get('description', ''))} |")
        out.append("")
    return "\n".join(out)


def field_names(model: Any, mode: str = "validation") -> dict[str, set[str]]:
    """{model or nested model name: its field names}: what the generated tables must list."""
    schema = model.model_json_schema(mode=mode)
    names = {model.__name__: set(schema.get("properties", {}))}
    for name, sch in schema.get("$defs", {}).items():
        names[name] = set(sch.get("properties", {}))
    return names


#: input files: (title, what the file is, the pydantic model it is validated against)
def input_models() -> list[tuple[str, str, Any]]:
    from coral.catalog import schema
    from coral.perf import measured

    out = [
        ("Scenario", "A scenario file (`coral run FILE.yaml`, every command taking a scenario): the models, their SLOs "
         "and traffic, the regions and node configs, the availability. Built-in: `coral/data/scenarios/`.",
         schema.Scenario),
        ("Offerings (market)", "An offerings file (`--offerings FILE`, or `offerings:` in a scenario): the instance "
         "types, prices, regions and node counts you can rent. Built-in: `coral/data/offerings.yaml`, "
         "`coral/data/markets/`.", schema.OfferingCatalog),
        ("Market snapshot", "What `coral serve --market FILE|URL` reads every `--market-poll` seconds: offerings "
         "and node counts that replace the running market.", schema.MarketSnapshot),
        ("Availability schedule", "`coral simulate --availability FILE` or a scenario's `availability_schedule`: "
         "node counts and prices that change over simulated time.", schema.AvailabilitySchedule),
        ("Model catalogue", "Model architectures (`coral/data/models.yaml`; `coral models add` writes your own into "
         "`$CORAL_HOME/models`).", schema.ModelCatalog),
        ("GPU catalogue", "GPU types (`coral/data/gpus.yaml`).", schema.GpuCatalog),
    ]
    for name in dir(measured):  # a measured profile's manifest (profile.yaml), when it is a pydantic model
        obj = getattr(measured, name)
        if isinstance(obj, type) and name.lower().startswith("profile") and hasattr(obj, "model_json_schema"):
            out.append((f"Measured profile ({name})", "`profile.yaml` beside a Helix-layout profile folder "
                        "(`coral perf calibrate DIR`).", obj))
    return out


def inputs_reference() -> str:
    out = ["Generated from the pydantic models every input file is validated against (`coral.catalog.schema`) when "
           "the docs are built. Files are YAML or JSON; unknown fields are refused, naming the file, line and field.",
           ""]
    seen: set[str] = set()
    for title, what, model in input_models():
        again = [f"Its fields: `{model.__name__}` above."] if model.__name__ in seen else []
        out += [f"## {title}", "", what, "", *again, "", model_tables(model, heading=3, seen=seen)]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# outputs

#: summary.json is a plain dict written by `coral run` (coral/cli/run.py); its keys, described here, are checked
#: against a real run's file by tests/test_docs.py, so a key added there fails until it is described here.
SUMMARY_FIELDS = {
    "scenario": "the scenario's name",
    "planned_cost_per_hour": "{method: $/h of its plan}: Coral's and each baseline's",
    "slo": "{method: the plan's `slo` block (`SloCheck` below)}: targets, tuned and held-out attainment, verdicts",
    "headroom": "{\"model/phase\": capacity planned ÷ mean traffic} of Coral's plan",
    "solve_seconds": "the allocator's solve time of Coral's plan, s",
    "simulated_cost_per_hour": "mean $/h of the re-planned simulation (sim.json)",
    "slo_attainment": "share of all requests of the re-planned simulation meeting both SLOs",
    "goodput_tokens_s": "generated tokens/s of requests that met both SLOs, re-planned simulation",
    "fixed_plan_slo_attainment": "{method: attainment of its plan held fixed on the same held-out requests}",
    "fixed_plan_cost_per_hour": "{method: $/h of its plan held fixed}",
    "wall_s": "seconds the whole run took",
    "missed": "why Coral's plan is not one that met every target, one line per reason (empty: it met them all)",
    "safety_net": "{method: what a wall-clock safety net stopped in its search}; empty: the plans depend on the "
                  "inputs alone, not on the machine's load",
    "rounds": "{method: search rounds taken}",
    "chosen_trial": "{method: whose round its plan is}: `subset` (homo-ilp's rounds), `planner` (its own), "
                    "`variant 1` (its own, pricing slack), `composed` or `refined`",
    "certified": "{method: {`seconds`, `windows_simulated`, `models`: {model: {`target`, `pass`, and the certified "
                 "figures of `WindowStats` below: `windows`, `pooled`, `lower_bound`, `confidence`, `p5`, `p50`, "
                 "`worst`}}}}: the certified verdict on held-out windows",
    "folder": "(`--json` only) the run's output folder",
    "report": "(`--json` only) the report's path",
    "current_plan": "(`--json` only) the current plan's path, or null when the plan missed a target",
}


def output_models() -> list[tuple[str, str, Any]]:
    from coral.allocation.plan import Plan
    from coral.report.inputs import ReportInputs
    from coral.simulation.metrics import SimResult

    return [
        ("Plan", "`plan.<mode>.<method>.json` (`coral run`), `<scenario>.<mode>.<method>[...].plan.json` (`coral "
         "allocate`), `<scenario>.current.plan.json`: the instances to run and why.", Plan),
        ("Simulation result", "`sim.json` and `sim.fixed.<method>.json` (`coral run`), `result.json` (`coral "
         "simulate`).", SimResult),
        ("Report inputs", "`report-inputs.json` (`coral run`): everything the HTML report shows beside the plan; "
         "`coral report --sim` takes it back.", ReportInputs),
    ]


def outputs_reference() -> str:
    out = ["Generated from the pydantic models the output files are written from when the docs are built "
           "(`coral.allocation.plan`, `coral.simulation.metrics`, `coral.report.inputs`), and for summary.json from "
           "the description of its keys that tests/test_docs.py checks against a real run.", "",
           "## `summary.json`", "", "Written by `coral run` in its folder; `coral run --json` prints the same "
           "document on stdout, with three more keys.", "", "| key | what it holds |", "|---|---|"]
    out += [f"| `{k}` | {_cell(v)} |" for k, v in SUMMARY_FIELDS.items()]
    out.append("")
    seen: set[str] = set()
    for title, what, model in output_models():
        out += [f"## {title}", "", what, "", model_tables(model, mode="serialization", heading=3, seen=seen)]
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "inputs": inputs_reference,
    "outputs": outputs_reference,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: replace each marker by its generated markdown."""
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)
