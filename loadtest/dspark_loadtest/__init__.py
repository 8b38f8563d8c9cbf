"""Locust load tests for DSpark Serve: SLA tiers as scenarios, per-request stream metrics, frontier sweeps."""
