"""A run: the loop every job runs on (loop.py) and what it asks — the run directory and its
claim, checkpoints, progress and the log, the budget, elastic resizes, W&B."""
