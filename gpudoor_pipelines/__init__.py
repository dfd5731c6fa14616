"""gpudoor_pipelines: one door to every GPU, as a Dagster code location.

Every GPU step of the team's flow (captioning, training, evaluation, demo) is described by a plain
SkyPilot task file in ``task_specs/``, routed to a pool of the fleet, and launched as a SkyPilot
managed job (or, with no configuration, as local processes with the same environment contract).
"""
