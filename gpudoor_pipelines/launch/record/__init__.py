"""Record: what a launch cost and where it ran, what its preemptions cost, and how its release went."""
