"""Workload: request traces (Azure LLM 2023, BurstGPT, synthetic), scaling a trace to a rate, and the traffic
statistics that size demand. Below both the allocator and the simulator, which read traces through it."""
