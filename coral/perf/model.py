"""The performance-model interface shared by the analytic roofline and measured profiles."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import numpy as np

from coral.catalog.loader import NodeConfig
from coral.catalog.schema import ModelArch


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Workload:
    """Mean request shape the throughput figures assume."""

    input_tokens: float
    output_tokens: float

    @property
    def decode_context(self) -> float:
        """Mean context length seen during decode."""
        return self.input_tokens + self.output_tokens / 2

    @property
    def max_context(self) -> float:
        return self.input_tokens + self.output_tokens


class PerfModel(Protocol):
    """Step time and budget-constrained throughput of one node holding `layers` layers of a model."""

    def step_time(
        self, model: ModelArch, phase: Phase, node: NodeConfig, layers: int, batch: float, workload: Workload
    ) -> float:
        """Seconds for one step: `batch` is prompt tokens (prefill) or sequences (decode)."""
        ...

    def max_layers(self, model: ModelArch, node: NodeConfig, workload: Workload) -> int:
        """Most layers that fit next to the minimum KV cache."""
        ...

    def throughput_table(
        self, model: ModelArch, phase: Phase, node: NodeConfig, budget_s: float, workload: Workload
    ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens/s, batch) for j = 0..L layers under a per-stage step budget; non-increasing in j, 0 where
        the layers do not fit or no batch meets the budget."""
        ...
