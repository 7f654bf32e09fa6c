"""Publishing: an export (or a checkpoint) uploaded to a Hugging Face hub repo, with a model card.

    runner export checkpoint=RUN format=merged push_to=hf://org/name[@branch]
    runner push PATH hf://org/name[@branch] [--public] [--hf-token env:NAME|file:PATH]

The repo is created private unless asked otherwise (an existing repo keeps its visibility); a
branch that does not exist is created from main. The token comes by reference, as everywhere
in runner, and reaches huggingface_hub only in memory. One commit holds the files and README.md,
a model card written from the run the files came from (base model, data, method, the key
hyperparameters, final metrics, the `runner train` command). A push cut short is resumed by
pushing again: large files already on the hub are not sent again (the hub's LFS batch answer
says so), and files whose content is already there are left out of the commit.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from runner.errors import UserError
from runner.hub.download import SCHEME, HubSource, out_of_reach, parse_uri
from runner.hub.token import HF_TOKEN_REF, TokenRef
from runner.paths import pasteable
from runner.rundir import (
    ADAPTER_CONFIG_FILE,
    CHECKPOINTS_DIR,
    TRAINING_STATE_FILE,
    RunDir,
    checkpoint_step,
    is_run_dir,
    is_sweep_dir,
)
from runner.rundir.manifest import MANIFEST_FILE, read_manifest

CARD_FILE = "README.md"


def parse_target(uri: str, key: str) -> HubSource:
    """The target hf://org/name[@branch] (`key`: push_to, or push's to): a model repo, no path
    inside it."""
    form = f"{SCHEME}org/name[@branch]"
    if not str(uri).startswith(SCHEME):
        # parse_uri reads what follows the scheme's length: hf:/acme/x would name cme/x.
        raise UserError(key, uri, f"give {form}")
    try:
        target = parse_uri(str(uri), key=key, repo_type="model")
    except UserError:  # its fix names the forms a download takes, paths in a repo among them
        target = None
    if target is None or target.path or target.repo_type != "model":
        raise UserError(key, uri, f"name a model repo and optionally a branch: {form}")
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # before an export, a card, a connection: as a download says
        raise UserError(
            key, uri, "HF_HUB_OFFLINE=1 keeps runner off the hub; unset HF_HUB_OFFLINE to push"
        )
    return target


def push_token(value: str | None, key: str) -> TokenRef:
    """The token reference a push sends (`key`: hf_token, or push's --hf-token), checked before
    anything is written: one that points at nothing is refused, as the push would go out with
    no token (huggingface_hub's login stands in only for null and an unset HF_TOKEN)."""
    token = TokenRef.parse(value, key=key)
    if token.read() is False:
        raise UserError(
            key, value, f"{token.state()}; set it to a token with write access to the repo"
        )
    return token


def check_pushable(path: Path, to: str) -> None:
    """Refuse a run dir (or its checkpoints/) and a sweep dir, naming what to push instead: they
    hold every checkpoint with its optimizer state, the logs and the status files, not a model."""

    def push_command(source: Path) -> str:
        return f"`runner push {shlex.quote(str(source))} {shlex.quote(to)}`"

    def export_command(source: Path) -> str:
        export = f"{pasteable('checkpoint', str(source))} {pasteable('push_to', to)}"
        return f"`runner export {export}`"

    if is_sweep_dir(path):
        one_run = path / "N" / CHECKPOINTS_DIR / "step_M"
        raise UserError(
            "path",
            str(path),
            f"a sweep dir, not a model: push one run's checkpoint, {push_command(one_run)}, or "
            f"export the sweep's best run first: {export_command(path)}",
        )
    run = path.parent if path.name == CHECKPOINTS_DIR else path
    if not is_run_dir(run):
        return
    what = "a run dir" if run == path else "a run's checkpoints folder"
    latest = RunDir(run).latest_checkpoint()
    if latest is None:
        raise UserError(
            "path",
            str(path),
            f"{what}, not a model, and {RunDir(run).without_checkpoint()}; then push that "
            f"({run / CHECKPOINTS_DIR / 'step_N'})",
        )
    raise UserError(
        "path",
        str(path),
        f"{what}, not a model (every checkpoint with its optimizer state, and the run's logs): "
        f"push its latest checkpoint, {push_command(latest)}, or export it first: "
        f"{export_command(run)}",
    )


def source_run(path: Path, checkpoint: Path | None = None) -> RunDir | None:
    """The run a checkpoint or an export came from: the checkpoint's run, or the run whose
    exports/ holds the export; None when it cannot be told."""
    for candidate in (checkpoint, path):
        if candidate is None:
            continue
        candidate = candidate.resolve()
        for parent in candidate.parents:
            if parent.name in (CHECKPOINTS_DIR, "exports") and is_run_dir(parent.parent):
                return RunDir(parent.parent)
    return None


def push(
    path: Path,
    target: HubSource,
    *,
    key: str,
    token: TokenRef,
    private: bool = True,
    checkpoint: Path | None = None,
) -> str:
    """Uploads `path` (a directory's files, or one file) and its model card in one commit to
    `target`; returns the commit's URL. A refused or failed push is one UserError naming `key`,
    the command's name for the target (export's push_to, push's to)."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    files = _files(path)
    run = source_run(path, checkpoint)
    pushed = checkpoint or path  # a checkpoint's step, whose metrics the card gives
    step = checkpoint_step(pushed) if pushed.parent.name == CHECKPOINTS_DIR else None
    card = model_card(path, target, files, run, step)
    written = {CARD_FILE: card.encode()} if CARD_FILE not in files else {}
    if ADAPTER_CONFIG_FILE in files:
        written[ADAPTER_CONFIG_FILE] = _adapter_config(files[ADAPTER_CONFIG_FILE], _recipe(run))
    operations = [
        CommitOperationAdd(name, written.pop(name) if name in written else str(local))
        for name, local in files.items()
    ]
    operations += [CommitOperationAdd(name, content) for name, content in written.items()]
    api = HfApi(token=token.read())
    try:
        api.create_repo(target.repo_id, private=private, exist_ok=True)
        if target.revision:
            api.create_branch(target.repo_id, branch=target.revision, exist_ok=True)
        commit = api.create_commit(
            target.repo_id,
            operations,
            commit_message=f"runner: upload {path.name}",
            revision=target.revision,
        )
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "no answer"
        fix = f"the hub refused the push (HTTP {status}: {_reason(err)})"
        if status in (401, 403):
            fix += f"; {token.state()} or it cannot write to {target.repo_id}"
        raise UserError(key, target.uri, f"{fix}; {_again(path, target, token, private)}") from None
    except out_of_reach() as err:  # a connection that failed or broke off
        raise UserError(
            key,
            target.uri,
            f"the hub ({constants.ENDPOINT}) is out of reach or the upload broke off "
            f"({type(err).__name__}: {err}); check the network (and HF_ENDPOINT), then "
            f"{_again(path, target, token, private)}",
        ) from None
    return commit.commit_url


def _again(path: Path, target: HubSource, token: TokenRef, private: bool) -> str:
    """The `runner push` that repeats this push: its target, visibility and token."""
    flags = ([] if private else ["--public"]) + (
        ["--hf-token", token.ref] if token.ref not in (None, HF_TOKEN_REF) else []
    )
    command = shlex.join(["runner", "push", str(path), target.uri, *flags])
    return f"`{command}` pushes again, sending only what the hub does not have"


def _adapter_config(local: Path, recipe: dict[str, Any]) -> bytes:
    """adapter_config.json as the hub gets it: the base named by its hub repo and commit, where
    the run read it from the hub. On disk it names the base by the path the run loaded it from
    (a cache snapshot), which loads on no other machine."""
    config = json.loads(local.read_text())
    pinned = (recipe.get("hub_sources") or {}).get("model.source")
    if pinned:
        base = parse_uri(pinned, key="model.source", repo_type="model")
        config.update(base_model_name_or_path=base.repo_id, revision=base.revision)
    else:
        print(
            f"warning: the adapter's base is {config.get('base_model_name_or_path')!r}, a local "
            "path; whoever loads it from the hub gives the base themselves",
            file=sys.stderr,
        )
    return (json.dumps(config, indent=2) + "\n").encode()


def _reason(err: Exception) -> str:
    response = getattr(err, "response", None)
    try:
        return json.loads(response.text)["error"] if response is not None else str(err)
    except (ValueError, KeyError, TypeError):
        return str(err).splitlines()[0]


def _files(path: Path) -> dict[str, Path]:
    """{path in the repo: local file}: a directory's files (hidden ones left out), or the file.
    A checkpoint's training_state.pt stays here: the optimizer's state, pickled, is no part of
    the model, and a hub flags a pickle as unsafe to load."""
    if path.is_file():
        return {path.name: path}
    if not path.is_dir():
        raise UserError("path", str(path), "no such file or directory: give an export's path")
    files = {
        str(p.relative_to(path)): p
        for p in sorted(path.rglob("*"))
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
        and p != path / TRAINING_STATE_FILE
    }
    if not files:
        raise UserError("path", str(path), "the directory holds no files to push")
    return files


# ---- the model card -----------------------------------------------------------------------
def model_card(
    path: Path,
    target: HubSource,
    files: dict[str, Path],
    run: RunDir | None,
    step: int | None = None,
) -> str:
    """README.md for the repo: YAML front matter (base_model, datasets, library_name, tags) and
    what the run did, read from its recipe.yaml, manifest.json and metrics.jsonl: its metrics
    up to `step`, the checkpoint's, where the files are one."""
    recipe = _recipe(run)
    adapter = (path / ADAPTER_CONFIG_FILE).is_file() if path.is_dir() else False
    gguf = any(name.endswith(".gguf") for name in files)
    library = "gguf" if gguf else ("peft" if adapter else "transformers")
    base = _hub_id(recipe, "model.source")
    data = _hub_id(recipe, "dataset.source")
    method = recipe.get("method", {}).get("name")
    front = ["---", f"library_name: {library}"]
    if base:
        front.append(f"base_model: {base}")
    if data:
        front += ["datasets:", f"  - {data}"]
    tags = ["runner", *([method] if method else []), *(["gguf"] if gguf else [])]
    front += ["tags:", *[f"  - {tag}" for tag in tags], "---", ""]
    lines = [*front, f"# {target.repo_id.split('/')[-1]}", ""]
    if run is None:
        lines += [f"`{path.name}`, uploaded with runner; the run it came from is not known.", ""]
    else:
        lines += _run_sections(run, recipe, base, data, step)
    lines += ["## Files", "", "| file | bytes |", "| --- | ---: |"]
    lines += [f"| `{name}` | {local.stat().st_size:,} |" for name, local in files.items()]
    return "\n".join(lines) + "\n"


def _recipe(run: RunDir | None) -> dict[str, Any]:
    if run is None or not run.recipe_path.is_file():
        return {}
    import yaml

    return yaml.safe_load(run.recipe_path.read_text()) or {}


def _hub_id(recipe: dict[str, Any], key: str) -> str | None:
    """org/name of a key that named an hf:// source, else None."""
    uri = (recipe.get("hub_sources") or {}).get(key)
    if not uri:
        return None
    return parse_uri(uri, key=key, repo_type=key.split(".")[0]).repo_id


def _run_sections(
    run: RunDir, recipe: dict[str, Any], base: str | None, data: str | None, step: int | None
) -> list[str]:
    model, dataset = recipe.get("model", {}), recipe.get("dataset", {})
    method = recipe.get("method", {})
    model_name = base or model.get("source") or model.get("name")
    lines = [
        f"Fine-tuned from `{model_name}` on `{data or dataset.get('source')}` with "
        f"[runner](https://pypi.org/project/runner/) ({method.get('name')}).",
        "",
        "## Training",
        "",
        "| key | value |",
        "| --- | --- |",
    ]
    keys = {
        "method": method.get("name"),
        "learning rate": recipe.get("optimizer", {}).get("lr"),
        "batch size per device": recipe.get("batch_size"),
        "gradient accumulation": recipe.get("gradient_accumulation_steps"),
        "max steps": recipe.get("max_steps"),
        "epochs": recipe.get("epochs"),
        "precision": recipe.get("dtype", {}).get("name"),
        "seed": recipe.get("seed"),
    }
    if "rank" in method:
        keys.update({"LoRA rank": method.get("rank"), "LoRA alpha": method.get("alpha")})
    lines += [f"| {key} | {value} |" for key, value in keys.items() if value is not None]
    lines += ["", "## Results", "", *_results(run, step), ""]
    if (run.path / MANIFEST_FILE).is_file():  # one that does not read is refused by name
        overrides = read_manifest(run).get("overrides", [])
        command = shlex.join(["runner", "train", *overrides])
        lines += ["## Reproduce", "", "```", command, "```", ""]
    return lines


def _results(run: RunDir, step: int | None) -> list[str]:
    """The last training loss and evaluation at or before `step` (None: the run's last)."""
    records = [r for r in run.read_metrics() if step is None or r["step"] <= step]
    losses = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    lines = []
    if losses:
        lines.append(f"- training loss {losses[-1]['loss']:.4f} at step {losses[-1]['step']}")
    if evals:
        metrics = ", ".join(
            f"{k} {v:.4f}"
            for k, v in evals[-1].items()
            if k.startswith("eval_") and isinstance(v, float)
        )
        lines.append(f"- at step {evals[-1]['step']}: {metrics}")
    return lines or ["- no metrics recorded"]


# ---- `runner push` --------------------------------------------------------------------------
