"""Offline RLHF: PPO for language models, verl-style, wrapped in a ZenML pipeline."""
