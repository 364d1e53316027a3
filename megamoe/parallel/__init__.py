"""Process groups, data parallelism and the optimizer."""
