"""Training: the loop, checkpoints, metrics, logging and schedules."""
