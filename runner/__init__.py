"""runner: a config-first fine-tuning runner (Hydra config groups -> torchtune-style recipe)."""

__version__ = "0.1.0"
