"""`--out` naming the wrong kind of path (a file where a folder is written, a folder where a file is, a file above
the folder) is a one-line error naming the flag, before any work, for every command that writes there."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coral.cli.main import app
from coral.runtime.handmade import make_instance, make_plan


def plan_file(folder: Path) -> Path:
    return make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 800.0)], scenario="core").save(
        folder / "plan.json")


FOLDER_OUT = [  # commands whose --out is a folder (the plan file is `{plan}`)
    ["deploy", "--engine", "vllm", "--plan", "{plan}", "--target", "commands"],
    ["deploy", "--plan", "{plan}", "--target", "kuberay", "--engine", "coral", "--checkpoint", "/ckpt"],
    ["allocate", "core"],
    ["experiment", "default"],
    ["run", "core"],
    ["simulate", "core"],
    ["templates", "build", "core"],
    ["perf", "profile", "--config", "1xL4", "--model", "phi-4"],
]
FILE_OUT = [  # commands whose --out is a file
    ["plan", "bom", "{plan}"],
    ["report", "--example"],
    ["perf", "calibrate"],
]


def invoke(args: list[str], plan: Path, out: Path) -> tuple[int, str]:
    """Exit code and output (its lines joined: rich wraps long paths)."""
    r = CliRunner().invoke(app, [a.format(plan=plan) for a in args] + ["--out", str(out)])
    return r.exit_code, " ".join(r.output.split())


@pytest.mark.parametrize("args", FOLDER_OUT, ids=lambda a: " ".join(a[:2]))
def test_a_file_where_a_folder_is_written_is_refused(tmp_path: Path, args: list[str]) -> None:
    plan, taken = plan_file(tmp_path), tmp_path / "taken"
    taken.write_text("mine\n")
    code, output = invoke(args, plan, taken)
    assert code == 2 and f"--out: {taken} is a file, not a folder" in output and "Traceback" not in output
    code, output = invoke(args, plan, taken / "sub")
    assert code == 2 and f"--out: cannot make folder {taken / 'sub'}: {taken} is a file" in output
    assert taken.read_text() == "mine\n"


@pytest.mark.parametrize("args", FILE_OUT, ids=lambda a: " ".join(a[:2]))
def test_a_folder_where_a_file_is_written_is_refused(tmp_path: Path, args: list[str]) -> None:
    plan, taken = plan_file(tmp_path), tmp_path / "taken"
    taken.mkdir()
    code, output = invoke(args, plan, taken)
    assert code == 2 and f"--out: {taken} is a folder, not a file" in output and "Traceback" not in output
    (tmp_path / "file").write_text("mine\n")
    code, output = invoke(args, plan, tmp_path / "file" / "bill.csv")
    assert code == 2 and f"{tmp_path / 'file'} is a file" in output
