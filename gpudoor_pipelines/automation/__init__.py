"""Schedules and sensors: the nightly captioning window, the morning merge, evals for new checkpoints."""
