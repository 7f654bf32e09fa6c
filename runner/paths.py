"""Where the packaged configs, recipes and embedded assets live (editable or installed alike)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

CONF_DIR = Path(str(files("runner.conf")))
RECIPES_DIR = Path(str(files("runner.recipes")))
ASSETS_DIR = Path(str(files("runner"))) / "assets"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
SAMPLE_DATA_DIR = ASSETS_DIR / "sample"


def config_groups() -> set[str]:
    """The config groups of conf/ (model, dataset, ..., hydra): its folders."""
    return {path.name for path in CONF_DIR.iterdir() if path.is_dir()}
