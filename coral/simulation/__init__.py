"""Event-driven simulator of PD-disaggregated serving: runs a plan (or a re-planner) on a request trace and
measures TTFT/TPOT, SLO attainment, goodput, cost and GPU utilisation without GPUs."""

from coral.simulation.availability import AvailabilitySchedule, load_availability
from coral.simulation.engine import ModelDemand, ObservedDemand, ObservedLatency, Replanner
from coral.simulation.metrics import SimResult
from coral.simulation.run import simulate
from coral.workload.traces import RequestSet, load_azure, load_burstgpt, rescale, synthetic, workload_for

__all__ = [
    "AvailabilitySchedule",
    "ModelDemand",
    "ObservedDemand",
    "ObservedLatency",
    "Replanner",
    "RequestSet",
    "SimResult",
    "load_availability",
    "load_azure",
    "load_burstgpt",
    "rescale",
    "simulate",
    "synthetic",
    "workload_for",
]
