"""Where the packaged configs, recipes and embedded assets live (editable or installed alike),
and paths as a user types them (`~`) and pastes them (an override of a path)."""

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


def pasteable(key: str, value: str) -> str:
    """`key=value` as one shell word that Hydra reads back as `value`: quoted for Hydra where its
    grammar reads the value otherwise (a letter outside ASCII, `,`, `=`, brackets, a number),
    then for the shell (a space)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = f"{key}={value}"
    try:
        plain = OverridesParser.create().parse_override(override).value() == value
    except Exception:  # Hydra's grammar refuses it as typed
        plain = False
    if not plain:
        escaped = value.replace("'", "\\'")  # a quote inside Hydra's quotes: \'
        override = f"{key}='{escaped}'"
        if not set(override) & set('$`"\\!'):  # as the CLI's own advice quotes: "key='value'"
            return f'"{override}"'
    return shlex.quote(override)
