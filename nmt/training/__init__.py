"""Training: the Lightning module, what a config builds for a run, its callbacks and schedules."""
