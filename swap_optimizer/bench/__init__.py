"""The peak-memory benchmark: ``python -m swap_optimizer.bench --help``."""
