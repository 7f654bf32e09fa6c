"""The trainer inside one training process: what surrounds the recipe (process, progress,
trackers, determinism) and the pieces recipes/finetune.py composes (placement, batches, weights,
methods, objectives, optimization, evaluation, checkpointing)."""
