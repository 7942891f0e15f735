"""The DeepSpeed-driven training loop, its schedule, checkpoints and logging."""
