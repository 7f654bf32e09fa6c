"""What runs a job: resolve and launch it, one training process, and the trainer's pieces the
recipes compose (placement, batches, optimization, methods, evaluation, checkpointing, progress)."""
