"""Quoting for the command lines the deployers write: every word is literal to bash (or to the kubelet) except
references to our own variables, a closed set (`DEPLOY_VARS`), so no string a plan or catalog carries can run a
command or read the environment."""

from __future__ import annotations

import re
import shlex

HEAD_ADDR_VAR = "CORAL_HEAD_ADDR"  # the rank-0 / node-0 machine (rendezvous)
NODE_ADDR_VAR = "CORAL_NODE_ADDR"  # the machine's own address
SCHEDULER_ADDR_VAR = "CORAL_SCHEDULER_ADDR"  # a Coral-engine instance's scheduler
PLAN_VAR = "CORAL_PLAN"  # the plan file (the scripts target)
SKY_RANK_VAR = "SKYPILOT_NODE_RANK"  # set by SkyPilot on each node of a task
DEPLOY_VARS = frozenset({HEAD_ADDR_VAR, NODE_ADDR_VAR, SCHEDULER_ADDR_VAR, PLAN_VAR, SKY_RANK_VAR})
"""The variables a rendered word may reference as `$NAME`; a `$` anywhere else is a literal dollar."""

_REF = re.compile(r"\$(" + "|".join(sorted(DEPLOY_VARS)) + r")(?!\w)")


def sh_word(word: str) -> str:
    """`word` as one bash word: single-quoted (`shlex.quote`) unless it references one of `DEPLOY_VARS`, then
    double-quoted with every `\\`, `"`, `$` and backtick escaped except those references."""
    parts = _REF.split(word)  # literal, var name, literal, ...
    if len(parts) == 1:
        return shlex.quote(word)
    return '"' + "".join(f"${p}" if k % 2 else re.sub(r'([\\"$`])', r"\\\1", p) for k, p in enumerate(parts)) + '"'


def sh_line(argv: list[str], env: dict[str, str] | None = None, exec_: bool = False, background: bool = False) -> str:
    """One bash line running `argv` with `env` set for it (`exec_`: replacing the shell; `background`: `&`)."""
    words = [f"{k}={sh_word(v)}" for k, v in (env or {}).items()]
    words += (["exec"] if exec_ else []) + [sh_word(a) for a in argv]
    return " ".join(words) + (" &" if background else "")


def k8s_literal(text: str) -> str:
    """`text` for a Kubernetes container's `command`, `args` or env value, which the kubelet reaches as written:
    every `$` doubled (the kubelet's escape), so no `$(NAME)` in it is expanded."""
    return text.replace("$", "$$")


def k8s_word(word: str) -> str:
    """`word` for a Kubernetes container's `args` or env value: references to `DEPLOY_VARS` become the kubelet's
    `$(NAME)`, everything else is `k8s_literal` (so `$(HF_TOKEN)` in a name stays literal)."""
    return "".join(f"$({p})" if k % 2 else k8s_literal(p) for k, p in enumerate(_REF.split(word)))
