"""Resolve: a task spec, the fleet and a launch request become the concrete task that runs.

``specs`` (task files, checked once per version), ``fleet`` (the pools and routes), ``features`` (what an
infra can run), ``routing`` (the one place that picks pool, infra and GPU), ``rules`` (the small fleet
rules), ``request`` (a launch request and the pure ``resolve``). Nothing here talks to a backend or Dagster.
"""
