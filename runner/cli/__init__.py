"""The `runner` command: dispatches to each subcommand's Hydra app, reports user errors once."""

from __future__ import annotations

import difflib
import importlib
import os
import select
import sys

from runner.config import interpolations
from runner.config.fields import MULTIRUN_FLAGS, override_key
from runner.config.hydra_errors import as_user_error
from runner.console import outlive_the_reader
from runner.errors import UserError, UserErrorExit, address_space_error, address_space_limit

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


# Each command is a module of this package, imported only when it runs (`runner --help` stays
# light): a Hydra command's module has `app` (its @hydra.main), the others `main(argv)`.
HYDRA_COMMANDS = ("train", "validate", "estimate", "download", "deploy", "export")
# The commands that compose train.yaml, whose defaults list chooses an option of every group.
TRAIN_CONFIG_COMMANDS = ("train", "validate", "estimate", "download")
LIFECYCLE_COMMANDS = ("runs", "logs", "stop", "resume")
COMMANDS = (*HYDRA_COMMANDS, "push", "repro", *LIFECYCLE_COMMANDS, "cluster")
# Hydra writes nothing for the commands that only look (validate, estimate, download): no run
# directory, no log file, no run lock.
NO_OUTPUT = [
    "hydra.output_subdir=null",
    "hydra.run.dir=.",
    "~hydra.callbacks.run_lock",
    "hydra/job_logging=console",
    "hydra/hydra_logging=disabled",
]


# Hydra's flags that print and exit before the task runs (--cfg job prints the config).
PRINT_AND_EXIT = (
    *("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info"),
    *("-sc", "--shell-completion"),
)


def _run(name: str, argv: list[str]) -> int | None:
    """Runs command `name` with the arguments after its name."""
    if name == "resume":
        from runner.cli.lifecycle import resume_argv

        name, *argv = resume_argv(argv)
    if name in ("train", "deploy") and not {"-h", "--help"} & set(argv):
        outlive_the_reader()  # `runner train ... | head` trains on once head has its lines
    if name == "train" and not _prints_or_sweeps(argv):
        _load_training_libraries_under_a_limit()  # where this process trains
    if name in LIFECYCLE_COMMANDS:
        from runner.cli.lifecycle import main as lifecycle_main

        return lifecycle_main(name, argv)
    module = importlib.import_module(f"runner.cli.{name}")
    if name not in HYDRA_COMMANDS:
        return module.main(argv)
    if name == "export":
        module.check_argv(argv)
    _warn_groups_given_twice(argv)
    _check_group_choices(name, argv)
    from runner.config.secrets import refuse_typed_secrets

    argv = _hydra_section_resolved(flags_first(argv))
    _refuse_config_path(argv)
    _check_searchpath(argv)
    _refuse_two_modes(argv)
    refuse_typed_secrets(argv)
    resumed = next(
        (a for a in argv if override_key(a) == "resume" and a.partition("=")[2] != "null"), None
    )
    if name == "train" and resumed and any(a in MULTIRUN_FLAGS for a in argv):
        # Each job would train a new directory of the sweep's, which holds no recipe to resume.
        raise UserError(
            "resume",
            resumed.partition("=")[2],
            "a sweep does not resume runs: resume each with runner resume RUN (a sweep's job: "
            "runner resume SWEEP/N; a whole sweep: its command with hydra.sweep.dir=SWEEP)",
        )
    if name in ("validate", "estimate", "download"):
        # hydra.mode=MULTIRUN is Hydra's other spelling of -m.
        given = next((a for a in argv if a in MULTIRUN_FLAGS), None)
        if given is not None:
            # Hydra would make a sweep directory, with a summary of jobs that never ran.
            raise UserError(
                given,
                None,
                f"runner {name} checks one config and writes nothing; drop {given} and give "
                "one value of each key (runner train -m sweeps them)",
            )
        argv = [*argv, *NO_OUTPUT]
    # Hydra's app reads its overrides and flags (-m, --cfg, --help) from sys.argv, and names
    # itself by sys.argv[0] in its --help.
    sys.argv = [f"runner {name}", *argv]
    return module.app()


def _prints_or_sweeps(argv: list[str]) -> bool:
    """Whether Hydra prints and exits (--cfg job, --cfg=job, -cjob) or sweeps (its jobs may
    train elsewhere): no training in this process."""
    for arg in argv:
        flag = arg.partition("=")[0]
        attached = arg[:2] in ("-c", "-i") and arg[2:] in ("job", "hydra", "all", *_INFO)
        if flag in PRINT_AND_EXIT or arg in MULTIRUN_FLAGS or attached:
            return True
    return False


def _load_training_libraries_under_a_limit() -> None:
    """Under an address-space limit (`ulimit -v`, as login nodes set), loads what training
    loads before Hydra makes the run directory: libraries that do not fit leave nothing behind
    (out of address space, the process could not even list the directory to remove it)."""
    if address_space_limit() is None:
        return
    from runner.job.launch import RECIPE_MODULE

    try:
        importlib.import_module(RECIPE_MODULE)
    except Exception as err:
        user_error = address_space_error(err)
        if user_error is None:
            raise
        raise user_error from err


# Hydra's flags that take a value, and --info's values: its parser takes the overrides as one
# run of positional arguments, so a flag between two overrides (model=x --config-dir D y=1) left
# the overrides after it "unrecognized" (listed with runner's own).
_FLAG_VALUES = {
    "--config-dir",
    "-cd",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--experimental-rerun",
}
_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def flags_first(argv: list[str]) -> list[str]:
    """`argv` with Hydra's flags (and their values) before the overrides, in their order."""
    flags: list[str] = []
    overrides: list[str] = []
    given = list(argv)
    while given:
        arg = given.pop(0)
        if arg in _FLAG_VALUES:
            if not given:
                raise UserError(arg, None, f"give its value after it ({arg} VALUE)")
            flags += [arg, given.pop(0)]
        elif arg in ("--info", "-i"):
            # --info's value is optional (all): a bare one, put before the overrides, took the
            # first of them as its value (--info seed=1: "invalid choice: 'seed=1'").
            flags += [arg, given.pop(0) if given and given[0] in _INFO else "all"]
        elif arg.startswith("-"):
            flags.append(arg)
        else:
            overrides.append(arg)
    return [*flags, *overrides]


def _refuse_config_path(argv: list[str]) -> None:
    """--config-path replaces the directory a command composes from: runner's conf/ (train.yaml
    and every group) was gone, and Hydra said only that a module or `train` was not found."""
    for at, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag in ("--config-path", "-cp"):
            given = value if equals else argv[at + 1]  # flags_first: a flag's value follows it
            raise UserError(
                flag,
                given,
                "replaces runner's own configs (train.yaml and its groups); add yours beside "
                f"them with --config-dir {given}",
            )


def _hydra_section_resolved(argv: list[str]) -> list[str]:
    """`argv`, where it asks for Hydra's section resolved (--cfg hydra --resolve), asking for it
    as a package of the whole config (--cfg all --package hydra), where its interpolations of
    the job's keys (hydra.run.dir: ${runtime.output_root}/...) resolve: Hydra resolved the
    section alone, and each was "no such key to interpolate"."""
    if "--resolve" not in argv:
        return argv
    shown = [*argv]
    for at, arg in enumerate(argv):
        if arg in ("--cfg", "-c") and argv[at + 1 : at + 2] == ["hydra"]:
            shown[at + 1] = "all"  # flags_first: a flag's value follows it
        elif arg in ("--cfg=hydra", "-chydra"):
            shown[at] = "--cfg=all"
    if shown == argv:
        return argv
    packaged = {"--package", "-p"} & {arg.partition("=")[0] for arg in argv}
    return shown if packaged else ["--package", "hydra", *shown]


def _check_searchpath(argv: list[str]) -> None:
    """Each entry of hydra.searchpath there, of a scheme Hydra reads: a directory (file://, or
    no scheme) or a package (pkg://). Hydra warned of one that is not there and composed
    without it (the user's model=mine was "no such option"), and a scheme it does not know was
    a traceback."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for arg in argv:
        if override_key(arg) != "hydra.searchpath" or arg.startswith("~"):
            continue
        try:
            given = OverridesParser.create().parse_override(arg).value()
        except Exception:  # noqa: BLE001 - Hydra's grammar refuses it: Hydra names it
            continue
        if isinstance(given, str):
            raise UserError("hydra.searchpath", given, f"give a list, hydra.searchpath=[{given}]")
        for entry in given if isinstance(given, list) else []:
            fix = _searchpath_fix(str(entry))
            if fix:
                raise UserError("hydra.searchpath", str(entry), fix)


def _searchpath_fix(entry: str) -> str | None:
    """What is wrong with a hydra.searchpath entry, and the fix; None where it is there."""
    from importlib.resources import files

    scheme, found, path = entry.partition("://")
    if not found:
        scheme, path = "file", entry  # Hydra reads a path without a scheme as a directory
    if scheme == "file":
        if os.path.isdir(path):
            return None
        return (
            "no such directory; give the directory that holds your own config groups "
            "(DIR/model/mine.yaml for model=mine), as file://DIR or DIR"
        )
    if scheme == "pkg":
        try:
            if files(path).joinpath("__init__.py").is_file():
                return None
        except (ModuleNotFoundError, ValueError, TypeError):
            pass
        return "no such package; give an importable package (with an __init__.py) of your groups"
    return f"Hydra reads no {scheme}:// scheme; give file://DIR (or DIR) or pkg://PACKAGE"


# Hydra's flags that each choose what its app does: one at a time.
_MODES = {
    **dict.fromkeys(("-r", "--run"), "--run"),
    **dict.fromkeys(("-m", "--multirun"), "--multirun"),
    **dict.fromkeys(("-c", "--cfg"), "--cfg"),
    **dict.fromkeys(("-i", "--info"), "--info"),
    **dict.fromkeys(("-sc", "--shell-completion"), "--shell-completion"),
}


def _mode(arg: str) -> str | None:
    """The mode a flag of Hydra's chooses (--cfg for --cfg, --cfg=job and -cjob), if any."""
    flag = arg.partition("=")[0]
    if arg[:2] in ("-c", "-i") and arg[2:] in ("job", "hydra", "all", *_INFO):
        flag = arg[:2]
    return _MODES.get(flag)


def _refuse_two_modes(argv: list[str]) -> None:
    """Hydra takes one of -m, --cfg, --info, ... and raised a ValueError at two (`-m --cfg
    job`, to see what a sweep's jobs would get): a traceback."""
    given = [(arg, _mode(arg)) for arg in argv if _mode(arg)]
    modes = {mode for _, mode in given}
    if len(modes) < 2:
        return
    printing = next((arg for arg, mode in given if mode in ("--cfg", "--info")), None)
    if "--multirun" in modes and printing is not None:
        # --cfg's value as given (job, hydra, all); --info's may be one flags_first wrote.
        value = argv[argv.index(printing) + 1] if printing in ("--cfg", "-c") else None
        raise UserError(
            printing,
            value,
            "prints one config and runs nothing, not a sweep's jobs: drop -m (--multirun) and "
            "give one value of each key to see what that job gets",
        )
    flags = " and ".join(arg for arg, _ in given)
    raise UserError(flags, None, "Hydra takes one of these at a time: give one")


def _warn_groups_given_twice(argv: list[str]) -> None:
    """Hydra keeps the last of a group chosen twice without a word: the keys of the first then
    read as unknown (`compute=multi_node compute=cpu compute.node_rank=0`)."""
    from runner.config.fields import groups_given_twice
    from runner.paths import config_groups

    groups = config_groups()
    for group, options in groups_given_twice(argv, groups).items():
        given = ", then ".join(f"{group}={option}" for option in options)
        print(
            f"warning: {group} is chosen {len(options)} times ({given}): only the last, "
            f"{group}={options[-1]}, is used; choose one and set its keys ({group}.KEY=VALUE)",
            file=sys.stderr,
        )


def _check_group_choices(name: str, argv: list[str]) -> None:
    """Each config group given one option of its own: set to null, a number or true/false
    (`model=null`, `compute=2`: Hydra raised a ValueError that named no group, "Config group
    override must be a string or a list"), a list (`model=[tiny,hf]`: Hydra merged both options
    into one), or added again (`+model=tiny`, `++model=tiny`: Hydra's "model appears more than
    once in the final defaults list", "force-add of config groups is not supported")."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.config.hydra_errors import OWN_KEYS
    from runner.errors import NULL
    from runner.paths import CONF_DIR, config_groups

    groups = config_groups()
    own_primary = {"--config-name", "-cn"} & {arg.partition("=")[0] for arg in argv}
    for override in argv:
        key, equals, value = override.partition("=")
        group = key.lstrip("+")
        if not equals or group not in groups:
            continue
        try:
            given = OverridesParser.create().parse_override(override).value()
        except Exception:  # noqa: BLE001 - Hydra's grammar refuses it: Hydra's message says so
            given = value
        if given is None or isinstance(given, (bool, int, float)):
            options = sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))
            own = OWN_KEYS.get((name, group))
            fix = (
                f"runner {name} has no {group} group; set {own} instead"
                if own
                else f"a config group takes an option by its name; choose one of: "
                f"{', '.join(options)}"
            )
            raise UserError(group, NULL if given is None else value, fix)
        if value.startswith("["):
            listed = value.strip("[]").replace(" ", "")
            raise UserError(
                group,
                value,
                f"a config group takes one option: give one, or add -m for one run per "
                f"option (-m {group}={listed})",
            )
        if key.startswith("+") and name in TRAIN_CONFIG_COMMANDS and not own_primary:
            raise UserError(
                group,
                value,
                f"runner {name} chooses a {group} already (a config group takes one option): "
                f"give {group}={value}, without {key.partition(group)[0]}",
            )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `runner` console script."""
    try:
        try:
            return _main(argv)
        finally:
            # What is still buffered meets a reader that left here, not in the interpreter's
            # flush at exit, which would print "Exception ignored ... BrokenPipeError". A
            # stdout closed (>&-) is None: print() writes nothing to it.
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_left():
            raise  # a pipe of the command's own (a worker, a socket), not its output
        # `runner train --help | head -1`: the reader has what it wanted. Python's recipe
        # (docs.python.org/3/library/signal.html#note-on-sigpipe): what is left to write goes
        # to devnull, and the command ends quietly, exit 1 as Python's own EPIPE exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean `runner {close[0]}`? " if close else ""
        print(
            f"error: command={name!r}: {hint}choose one of: {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    try:
        os.getcwd()  # which Hydra reads first: a 40-line traceback where it was removed
    except FileNotFoundError:
        print("error: the current directory no longer exists; cd to one that does", file=sys.stderr)
        return 2
    # Hydra raises instead of printing its own report, so every user error reads the same.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    interpolations.register()
    try:
        code = _run(name, argv[1:])
    except KeyboardInterrupt:
        # A second Ctrl-C, or one outside a training loop (which saves and exits 130 itself).
        print("interrupted", file=sys.stderr)
        return 130
    except UserErrorExit as err:
        print(f"error: {err.error}", file=sys.stderr)
        return err.error.exit_code
    except PermissionError as err:  # another user's run or file, on a shared disk
        where = err.filename or "a file"
        print(
            f"error: {where}: permission denied to this user (uid {os.getuid()}); run the "
            "command as a user who may read and write it",
            file=sys.stderr,
        )
        return UserError.exit_code
    except Exception as err:  # noqa: BLE001 - classified below, re-raised if not a user error
        user_error = as_user_error(err, command=name)
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr)
        return user_error.exit_code
    return code or 0
