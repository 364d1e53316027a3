"""Training loop, schedules, LR schedule, checkpoints and logging."""
