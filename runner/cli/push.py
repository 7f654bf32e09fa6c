"""`runner push PATH hf://org/name[@branch]`: upload an export or a checkpoint, with its card."""

from __future__ import annotations

import re

from runner.cli.arguments import ArgumentParser
from runner.errors import UserError
from runner.hub.download import SCHEME
from runner.hub.push import check_pushable, parse_target, push, push_token
from runner.paths import refuse_empty_path, user_path
from runner.rundir import is_checkpoint_dir


def main(argv: list[str]) -> int:
    """`runner push PATH hf://org/name[@branch]`: prints the commit URL."""
    parser = ArgumentParser(
        prog="runner push",
        description="Upload an export or a checkpoint to a Hugging Face hub repo, with a model "
        "card; pushing again sends only what the hub does not have.",
    )
    parser.add_argument(
        "path",
        help="an export (directory or .gguf file) or a checkpoint dir (RUN/checkpoints/step_N), "
        "not a run or sweep dir",
    )
    parser.add_argument("to", help=f"{SCHEME}org/name[@branch]")
    parser.add_argument("--public", action="store_true", help="create the repo public")
    parser.add_argument(
        "--hf-token", default="env:HF_TOKEN", help="env:NAME or file:PATH (never the token)"
    )
    args = parser.parse_args(argv)
    refuse_empty_path("path", args.path, "give an export's path")
    path = user_path(args.path)
    if not path.exists():
        fix = "no such file or directory: give an export's path"
        if re.match(r"[\w.]+=", args.path):  # checkpoint=DIR, as deploy and export take it
            fix += f" as it is, not as a key: runner push PATH {SCHEME}org/name"
        raise UserError("path", args.path, fix)
    check_pushable(path, args.to)
    target = parse_target(args.to, "to")
    token = push_token(args.hf_token, key="--hf-token")
    checkpoint = path if is_checkpoint_dir(path) else None
    pushed = push(
        path, target, key="to", token=token, private=not args.public, checkpoint=checkpoint
    )
    print(pushed)
    return 0
