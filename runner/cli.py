"""The `runner` command: dispatches to each subcommand's Hydra app, reports user errors once."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable

from runner import resolvers
from runner.errors import UserError, UserErrorExit

USAGE = """usage: runner COMMAND [hydra overrides] [--help]

commands:
  train    compose config groups, resolve a recipe, train and checkpoint
  validate print the resolved recipe; check that weights, tokenizer and data are there
  estimate parameters, memory per device and tokens per epoch, before training
  download fetch the hf:// models and datasets a config names into the cache, ahead of time
  deploy   serve checkpoints behind an OpenAI-compatible API
  export   write a checkpoint as a LoRA adapter, a merged model, or a GGUF file
  push     upload an export or a checkpoint to a Hugging Face hub repo, with a model card
  repro    re-run a recorded run and compare; exit 1 on drift (for CI)
  runs     list runs and sweep jobs: state, step, loss, best eval, age
  logs     print or follow (-f) a run's log
  stop     ask a run to save a checkpoint and end as cancelled
  resume   continue a cancelled or failed run from its last whole checkpoint
  cluster  print the Slurm batch script and Kubeflow TrainJob of a multi-node run (dry run)

`runner COMMAND --help` lists the command's config groups and options."""


def _commands() -> dict[str, Callable[[], int | None]]:
    def train() -> None:
        # A sweep (-m) exits with its failed-job count, read from its summary.json (runner.sweep).
        from runner.train import main

        main()

    def deploy() -> None:
        from runner.deploy import main

        main()

    def export() -> None:
        from runner.export import check_argv, main

        check_argv(sys.argv[1:])
        main()

    def preflight(name: str) -> Callable[[], None]:
        def run() -> None:
            from runner import preflight

            sys.argv += preflight.NO_OUTPUT
            getattr(preflight, f"{name}_main")()

        return run

    def download() -> None:
        from runner import hub, preflight

        sys.argv += preflight.NO_OUTPUT
        hub.download_main()

    def push() -> int:
        from runner.publish import main

        return main(sys.argv[1:])

    def repro() -> int:
        from runner.repro import main

        return main(sys.argv[1:])

    def lifecycle(command: str) -> Callable[[], int]:
        def run() -> int:
            from runner.lifecycle import main

            return main(command, sys.argv[1:])

        return run

    def cluster() -> int:
        from runner.cluster import main

        return main(sys.argv[1:])

    lifecycle_commands = {name: lifecycle(name) for name in ("runs", "logs", "stop", "resume")}
    return {
        "train": train,
        "validate": preflight("validate"),
        "estimate": preflight("estimate"),
        "download": download,
        "deploy": deploy,
        "export": export,
        "push": push,
        "repro": repro,
        **lifecycle_commands,
        "cluster": cluster,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `runner` console script."""
    argv = sys.argv[1:] if argv is None else argv
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    name = argv[0]
    if name not in commands:
        close = difflib.get_close_matches(name, commands, n=1)
        hint = f"did you mean `runner {close[0]}`? " if close else ""
        print(
            f"error: command={name!r}: {hint}choose one of: {', '.join(commands)}", file=sys.stderr
        )
        return 2
    # Hydra raises instead of printing its own report, so every user error reads the same.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    resolvers.register()
    sys.argv = [f"runner {name}", *argv[1:]]
    try:
        code = commands[name]()
    except KeyboardInterrupt:
        # A second Ctrl-C, or one outside a training loop (which saves and exits 130 itself).
        print("interrupted", file=sys.stderr)
        return 130
    except UserErrorExit as err:
        print(f"error: {err.error}", file=sys.stderr)
        return err.error.exit_code
    except Exception as err:  # noqa: BLE001 - classified below, re-raised if not a user error
        user_error = as_user_error(err)
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr)
        return user_error.exit_code
    return code or 0


def as_user_error(err: BaseException) -> UserError | None:
    """Our UserError, or a Hydra/OmegaConf composition error recast as one; None otherwise."""
    from runner.config_errors import from_hydra_error

    while err is not None:
        if isinstance(err, UserError):
            return err
        converted = from_hydra_error(err)
        if converted is not None:
            return converted
        err = err.__cause__ or err.__context__
    return None
