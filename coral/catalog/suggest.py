"""'Did you mean' hints for names a user typed (models, GPUs, configs, regions, scenarios) that are not known."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.7
"""How alike (difflib's ratio, 0..1) a known name must be to be suggested: 'L40' finds 'L40S' (0.86), 'aws-us-east-3'
does not find 'aws-ap-northeast-2' (0.65)."""


def close_names(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` known names close to `name`, closest first, in the order of `known` where equally close; case does
    not count ('l40s' finds 'L40S')."""
    folded = name.casefold()
    scored = []
    for i, k in enumerate(dict.fromkeys(known)):
        ratio = difflib.SequenceMatcher(None, folded, k.casefold()).ratio()
        if ratio >= CUTOFF:
            scored.append((-ratio, i, k))
    return [k for _, _, k in sorted(scored)[:n]]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'X'?)' naming the known names close to `name`, or '' when none is."""
    close = close_names(name, known)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
