"""Performance model: step times and budget-constrained throughput of a node holding j layers."""

from coral.perf.model import PerfModel, Phase, Workload
from coral.perf.roofline import PerfParams, RooflineModel

__all__ = ["PerfModel", "PerfParams", "Phase", "RooflineModel", "Workload"]
