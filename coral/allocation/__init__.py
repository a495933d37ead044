"""The online stage: demand, availability, the allocation MILP, scarcity modes and baselines."""

from coral.allocation.allocator import UNLIMITED, InfeasibleDemand, allocate, resolve_availability
from coral.allocation.demand import phase_demand, scenario_demand
from coral.allocation.plan import Plan

__all__ = ["UNLIMITED", "InfeasibleDemand", "Plan", "allocate", "phase_demand", "resolve_availability",
           "scenario_demand"]
