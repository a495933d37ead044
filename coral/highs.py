"""HiGHS solver objects without the copyright banner the library prints to stdout on construction."""

from __future__ import annotations

import os
import sys

import highspy


def quiet_highs() -> highspy.Highs:
    """A `highspy.Highs` with output off; its construction banner is sent to /dev/null."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    h.setOptionValue("output_flag", False)
    return h
