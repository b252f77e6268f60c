"""The training loop and what it needs around it: schedulers, checkpoints, metrics, evaluation."""
