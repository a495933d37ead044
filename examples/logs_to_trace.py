"""Turn your own request logs into a Coral trace file and the numbers a scenario needs.

    python examples/logs_to_trace.py examples/traces/requests.jsonl examples/traces/my-trace.csv

Input: one JSON object a line, as most gateways log them (OpenAI-style usage fields): a timestamp (`timestamp`,
`created` or `time`: Unix seconds or an ISO 8601 date-time), `prompt_tokens` and `completion_tokens` (or a
`usage` object holding them), and optionally `model`. `--model NAME` keeps only that model's lines.

Output: a CSV in the Azure LLM inference trace format (`TIMESTAMP,ContextTokens,GeneratedTokens`) that
`coral simulate --trace MODEL=FILE` reads, and, on stdout, the request rate and mean lengths to put in the
scenario (`request_rate`, `mean_input_tokens`, `mean_output_tokens`). Guide: docs/guides/scenario.md.
"""

from __future__ import annotations

import argparse
import csv
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def _seconds(value: Any) -> float:
    """Unix seconds from a number or an ISO 8601 string (no zone: UTC)."""
    if isinstance(value, int | float):
        return float(value)
    stamp = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def read_log(path: Path, model: str | None = None) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, generated tokens) of every successful request in the log, by arrival."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if model is not None and rec.get("model") != model:
            continue
        usage = rec.get("usage", rec)
        stamp = next((rec[k] for k in ("timestamp", "created", "time") if k in rec), None)
        if stamp is None:
            raise SystemExit(f"{path}:{n}: no timestamp, created or time field")
        prompt, output = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        if prompt > 0 and output > 0:  # failed requests (no output) are not traffic to plan for
            rows.append((_seconds(stamp), prompt, output))
    if len(rows) < 2:
        raise SystemExit(f"{path}: fewer than 2 successful requests{f' of {model}' if model else ''}")
    return sorted(rows)


def write_trace(rows: list[tuple[float, int, int]], out: Path) -> None:
    """The Azure trace layout: TIMESTAMP as a date-time, ContextTokens, GeneratedTokens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for t, prompt, output in rows:
            w.writerow([datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S.%f"), prompt, output])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path, help="JSON-lines request log")
    ap.add_argument("trace", type=Path, help="trace CSV to write")
    ap.add_argument("--model", help="keep only this model's requests")
    args = ap.parse_args()
    rows = read_log(args.log, args.model)
    write_trace(rows, args.trace)
    span = rows[-1][0] - rows[0][0]
    print(f"wrote {args.trace}: {len(rows)} requests over {span:.0f} s")
    print(f"request_rate: {len(rows) / span:.3g}")
    print(f"mean_input_tokens: {sum(r[1] for r in rows) / len(rows):.0f}")
    print(f"mean_output_tokens: {sum(r[2] for r in rows) / len(rows):.0f}")


if __name__ == "__main__":
    main()
