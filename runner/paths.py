"""Where the packaged configs, recipes and embedded assets live (editable or installed alike)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

CONF_DIR = Path(str(files("runner.conf")))
RECIPES_DIR = Path(str(files("runner.recipes")))
ASSETS_DIR = Path(str(files("runner"))) / "assets"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tiny_tokenizer"
SAMPLE_DATA_DIR = ASSETS_DIR / "sample"


def user_path(given: object) -> Path:
    """A path a user typed, `~` expanded as the shell does unquoted: Hydra keeps a quoted
    `hydra.run.dir='~/runs'` as typed, and a directory named `~` was made in the working
    directory."""
    return Path(str(given)).expanduser()


def config_groups() -> set[str]:
    """The config groups of conf/ (model, dataset, ..., hydra): its folders."""
    return {path.name for path in CONF_DIR.iterdir() if path.is_dir()}
