"""The team's data in the transit bucket: datasets and their shards, captions, checkpoints, and the
synthetic sample. Free of Dagster (the assets use it; ``synthetic`` is shared with the workloads)."""
