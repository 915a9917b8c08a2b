"""The PPO engine around the workers: the loop, its guards, checkpoints, loggers and gauges."""
