"""The `coral` command line: a thin layer over the stage packages. Each sub-module registers its commands."""

from __future__ import annotations

import typer

from coral.cli import allocate, deploy, models, perf, report, run, runtime, simulate, templates

app = typer.Typer(
    name="coral",
    help="Cost-efficient multi-LLM serving over heterogeneous cloud GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for module in (run, models, perf, templates, allocate, simulate, runtime, deploy, report):
    module.register(app)


if __name__ == "__main__":
    app()
