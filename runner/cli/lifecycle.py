"""`runner runs | logs | stop | resume`: the lifecycle of runs on this machine or a shared disk."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from runner.cli.arguments import ArgumentParser, path_argument, seconds_argument
from runner.errors import UserError
from runner.job.lifecycle import (
    LogReader,
    check_resumable,
    find_runs,
    request_stop,
    run_dir_at,
    run_roots,
    runs_table,
    stall_note,
    status_missing,
    stopped_processes,
    sweep_it_ends,
    wait_until_final,
)
from runner.paths import shell_path
from runner.rundir import FINAL_STATES, LOG_FILE, STALLED, RunDir

# How long `runner logs -f RUN` waits for a run to start at RUN, where none is yet: a
# `runner train hydra.run.dir=RUN &` typed just before takes seconds to make it.
FOLLOW_APPEAR_S = 30.0
# RUN, as stop, logs and resume take it.
RUN_PATH = path_argument("RUN", "give a run directory (`runner runs` lists them)")


def main(command: str, argv: list[str]) -> int:
    """Entry point of `runner runs|logs|stop`."""
    parser = ArgumentParser(prog=f"runner {command}")
    if command == "runs":
        parser.description = "List runs and sweep jobs with state, step, loss, best eval, age."
        parser.add_argument(
            "dirs",
            nargs="*",
            type=path_argument("DIR", "give a directory of runs, or none for ./outputs ./multirun"),
            metavar="DIR",
            help="directories to search (default: ./outputs ./multirun)",
        )
    else:
        parser.add_argument("run", type=RUN_PATH, metavar="RUN", help="a run directory")
    if command == "logs":
        parser.description = "Print a run's log; -f follows it until the run ends."
        parser.add_argument("-f", "--follow", action="store_true")
        parser.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    if command == "stop":
        parser.description = "Ask a run to save a checkpoint and end as cancelled."
        parser.add_argument(
            "--timeout",
            type=seconds_argument("--timeout"),
            default=300.0,
            help="seconds to wait for it to stop (default 300)",
        )
    args = parser.parse_args(argv)
    return {"runs": cmd_runs, "logs": cmd_logs, "stop": cmd_stop}[command](args)


def cmd_runs(args: argparse.Namespace) -> int:
    roots = run_roots(args.dirs)
    unreadable: list[Path] = []
    runs = find_runs(roots, unreadable)
    if runs:
        print(runs_table(runs, Path.cwd()))
    else:
        print(f"no runs under {', '.join(map(str, roots))}")
        for root in roots:
            if status_missing(RunDir(root)):
                print(
                    f"{root}: a run's directory whose status.json is missing; `runner logs "
                    f"{shell_path(root)}` shows its log, and `runner resume {shell_path(root)}` "
                    "says how to go on from its last checkpoint",
                    file=sys.stderr,
                )
    if unreadable:
        print(f"not read (permission denied): {', '.join(map(str, unreadable))}", file=sys.stderr)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    # The log is worth reading whatever its status.json says.
    appear_s = FOLLOW_APPEAR_S if args.follow else 0
    reader = LogReader(run_dir_at(args.run, readable=False, appear_s=appear_s))
    if reader.ended() and not (reader.run.path / LOG_FILE).is_file():
        raise UserError("RUN", str(args.run), f"the run is over and wrote no {LOG_FILE}")
    while True:
        sys.stdout.write(reader.read())
        sys.stdout.flush()
        if not args.follow or reader.ended():
            return 0
        time.sleep(args.interval)


def cmd_stop(args: argparse.Namespace) -> int:
    run = run_dir_at(args.run)
    state, why = run.effective_state()
    stopped = stopped_processes(run) if state == STALLED else []
    pid = request_stop(run)
    print(f"asked process {pid} to save a checkpoint and stop")
    sweep = sweep_it_ends(run)
    if sweep is not None:
        print(
            f"{sweep}: the sweep stops with it, as its jobs run one after another in that "
            "process, and starts no other job; its own command given again with "
            f"hydra.sweep.dir={sweep} goes on with the sweep"
        )
    if state == STALLED:
        print(stall_note(run, why, stopped, args.timeout))
    state = wait_until_final(run, args.timeout)
    if state in FINAL_STATES:
        print(f"{run.path}: {state} at step {run.status().step}")
        return 0 if state == "cancelled" else 1
    print(f"{run.path}: still {state} after {args.timeout:.0f} s", file=sys.stderr)
    return 1


def resume_argv(argv: list[str]) -> list[str]:
    """`runner resume RUN`: the `runner train` arguments that continue RUN, once it is checked."""
    parser = ArgumentParser(
        prog="runner resume",
        description="Continue a cancelled or failed run from its last whole checkpoint.",
    )
    parser.add_argument("run", type=RUN_PATH, metavar="RUN", help="a run directory")
    run = run_dir_at(parser.parse_args(argv).run)
    check_resumable(run)
    return ["train", f"resume={run.path.resolve()}"]
