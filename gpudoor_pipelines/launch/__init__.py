"""Resolve, launch and record GPU jobs: task specs, the fleet, routing, fleet rules and backends."""
