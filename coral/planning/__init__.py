"""SLO-true planning: the allocator with the simulator in the loop, so that a plan is the cheapest one found that
meets every model's SLO-attainment target on real traffic, checked on requests it was not tuned on."""

from coral.planning.slo_search import (
    SearchResult,
    SearchSettings,
    allocator_planner,
    homogeneous_subset,
    search_method,
    search_plan,
    slack_variants,
)

__all__ = ["SearchResult", "SearchSettings", "allocator_planner", "homogeneous_subset", "search_method", "search_plan",
           "slack_variants"]
