"""The `coral` command line: a thin layer over the stage packages. Each sub-module registers its commands.

The sub-modules import the stage packages inside their commands (coral.cli.common), so that `coral --help` and
`coral --version` load as little as possible; tests/test_cli_output.py checks which packages stay unloaded."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup, TyperOption

from coral import __version__
from coral.cli import allocate, deploy, models, perf, plan, report, run, runtime, simulate, templates


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"coral {__version__}")
        raise typer.Exit()


def hide_flag_types(command: Any, ctx: Any) -> None:
    """Blank the type of every flag of `command` and of its subcommands, their `--help` included: typer's rich help
    otherwise prints `<bool>` beside an option that takes no value."""
    for param in [*command.params, command.get_help_option(ctx)]:
        if isinstance(param, TyperOption) and param.is_flag:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        hide_flag_types(sub, ctx)


class CoralGroup(TyperGroup):
    """The root command: before it parses the command line (and so before any `--help` is shown), its flags and
    every subcommand's have their `<bool>` type blanked (`hide_flag_types`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        hide_flag_types(self, ctx)
        return super().parse_args(ctx, args)


#: the documentation page each command's help ends with (paths inside the repository: there is no hosted site)
DOCS_PAGES = {
    "": "docs/index.md",
    "run": "docs/guides/reading-a-plan.md",
    "allocate": "docs/guides/market.md",
    "experiment": "docs/results/index.md",
    "simulate": "docs/guides/replan.md",
    "serve": "docs/guides/serve.md",
    "gateway": "docs/guides/deploy.md",
    "status": "docs/guides/serve.md",
    "deploy": "docs/guides/deploy.md",
    "report": "docs/guides/reading-a-plan.md",
    "models": "docs/guides/scenario.md",
    "perf": "docs/architecture.md",
    "templates": "docs/concepts.md",
    "plan": "docs/guides/reading-a-plan.md",
}


def docs_epilog(page: str) -> str:
    """The last line of a command's help: the page to read, and the generated reference of every option."""
    return f"Docs: {page} (every command and option: docs/reference/cli.md)"


app = typer.Typer(
    name="coral",
    cls=CoralGroup,
    help="Cost-efficient multi-LLM serving over heterogeneous cloud GPUs.",
    epilog=docs_epilog(DOCS_PAGES[""]),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    _version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                  help="print the version and exit"),
) -> None:
    """The root's own options (`--version`)."""


for module in (run, models, perf, templates, allocate, simulate, runtime, deploy, report, plan):
    module.register(app)


def _add_docs_epilogs(root: typer.Typer) -> None:
    """End every command's and command group's help with the docs page to read (`DOCS_PAGES`; a group's
    subcommands take the group's page)."""
    for command in root.registered_commands:
        name = command.name or (command.callback.__name__ if command.callback else "")
        command.epilog = docs_epilog(DOCS_PAGES.get(name, DOCS_PAGES[""]))
    for group in root.registered_groups:
        page = DOCS_PAGES.get(group.name or "", DOCS_PAGES[""])
        group.epilog = docs_epilog(page)
        if group.typer_instance is not None:
            for command in group.typer_instance.registered_commands:
                command.epilog = docs_epilog(page)


_add_docs_epilogs(app)


if __name__ == "__main__":
    app()
