"""The lifecycle of runs on this machine or a shared disk: find, list, stop, check for resume.

`runner runs | logs | stop | resume` (runner.cli.lifecycle) and runner.api use these.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

from runner.errors import UserError
from runner.paths import pasteable
from runner.rundir import (
    FINAL_STATES,
    LOG_FILE,
    STALLED,
    STATUS_FILE,
    STOPPING,
    SWEEP_LOCK_FILE,
    RunDir,
    is_run_dir,
    its_jobs_instead,
    lock_held,
    pid_stopped,
)
from runner.rundir.lock import LOCK_FILE
from runner.rundir.status import number

DEFAULT_ROOTS = ("outputs", "multirun")
# How long a resume waits for the workers of a launcher that is gone (kill -9 of its process
# group) to save a checkpoint and end the run; past it, it is refused as any locked run is.
ORPHANS_WAIT_S = 300.0


def run_dir_at(
    path: Path, key: str = "RUN", *, readable: bool = True, appear_s: float = 0
) -> RunDir:
    """The run at `path`; one that is starting (its launcher holds the lock while it resolves
    the recipe and checks the data, seconds before it records its status) is waited for.
    readable: refuse a run whose status.json cannot be read or is missing (no state to stop or
    resume by); else such a run is taken where it wrote its train.log.
    appear_s: how long to wait for a run to start at a path that holds none yet (`runner logs
    -f RUN` typed just after `runner train hydra.run.dir=RUN &`, which takes seconds to start);
    a directory that holds files and no starting run's lock is answered at once (a copied run
    without its status.json was waited on for the whole of it)."""
    run = RunDir(path)
    deadline = time.monotonic() + appear_s
    waiting = False
    while not is_run_dir(run.path) and (
        lock_held(run.path) or (time.monotonic() < deadline and _holds_nothing(run.path))
    ):
        if not waiting:
            print(
                f"{path}: the run is starting; waiting for its status.json"
                if lock_held(run.path)
                else f"{path}: no run there yet; waiting up to {appear_s:.0f} s for one to start",
                file=sys.stderr,
            )
            waiting = True
        time.sleep(0.1)
    if status_missing(run):
        # `runner runs` lists no run there, so it is not the way on. Its log is read all the same.
        if readable or not (run.path / LOG_FILE).is_file():
            raise _state_unknown(run, key, "is missing")
        return run
    if not is_run_dir(run.path):
        sweeps = its_jobs_instead(run.path)
        if sweeps:  # `runner resume SWEEP` said only "not a run directory"
            raise UserError(key, str(path), sweeps)
        found = "not a run directory (no status.json)" if path.exists() else "no such directory"
        raise UserError(key, str(path), f"{found}; `runner runs` lists the runs here")
    if readable and _unreadable(run):
        raise _state_unknown(run, key, "cannot be read (cut short, or not runner's)")
    return run


def _holds_nothing(path: Path) -> bool:
    """Whether no run has started at `path`: it is missing, or holds at most a lock file (a
    run takes its lock before Hydra writes into the directory)."""
    try:
        return all(entry.name == LOCK_FILE for entry in path.iterdir())
    except OSError:  # missing, or not a directory
        return not path.exists()


def status_missing(run: RunDir) -> bool:
    """Whether `run` is a run's directory without its status.json (a partial copy, a
    clean-up): its recipe or checkpoints are there."""
    return not is_run_dir(run.path) and (run.recipe_path.is_file() or bool(run.checkpoints()))


def _state_unknown(run: RunDir, key: str, why: str) -> UserError:
    """A run whose status.json `why` (is missing, cannot be read): no state to go on by, and
    the way on from its last whole checkpoint."""
    latest = run.latest_checkpoint()
    return UserError(
        key,
        str(run.path),
        f"its status.json {why}, so its state is unknown; "
        + (
            f"start a new run from its last checkpoint: runner train "
            f"{pasteable('load_checkpoint.path', str(latest))}"
            if latest
            else "it saved no checkpoint: train it again under another hydra.run.dir"
        ),
    )


def _unreadable(run: RunDir) -> bool:
    """Whether the run's status.json says no state and no process of the run is left to."""
    return run.status().state == "unknown" and not lock_held(run.path)


def run_roots(dirs: list[Path]) -> list[Path]:
    """Where to look for runs: `dirs`, each a directory, else ./outputs and ./multirun."""
    missing = [root for root in dirs if not root.is_dir()]
    if missing:
        found = "a file" if missing[0].exists() else "no such directory"
        raise UserError("DIR", str(missing[0]), f"{found}; give a directory that holds runs")
    return dirs or [Path(d) for d in DEFAULT_ROOTS]


def find_runs(roots: list[Path], unreadable: list[Path] | None = None) -> list[RunDir]:
    """Run directories under `roots`, newest first: by when each last wrote its status, as
    the age column reads it (an export into an old run's directory made it newer). A directory
    that cannot be read is added to `unreadable` (where given); one removed while the roots are
    read is passed over, as a run on a shared disk may be by its owner's cleanup."""

    def passed_over(err: OSError) -> None:
        if unreadable is not None and not isinstance(err, FileNotFoundError):
            unreadable.append(Path(err.filename))

    found: dict[Path, float] = {}
    for root in roots:
        for here, subdirs, files in os.walk(root, onerror=passed_over):
            if STATUS_FILE in files:
                subdirs.clear()  # a run holds no runs: its checkpoints are not searched
                with contextlib.suppress(OSError):
                    found[Path(here)] = os.stat(os.path.join(here, STATUS_FILE)).st_mtime
    return [RunDir(path) for path in sorted(found, key=found.__getitem__, reverse=True)]


def _age(iso: str | None) -> str:
    if not iso:
        return "-"
    # A time ahead of this machine's clock (another host's, on a shared disk) is just now.
    return _duration(max(0.0, (datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds()))


def _duration(seconds: float) -> str:
    """Whole units gone by, as clocks read them: 90 s is 1m (rounded, it read 2m, and a run
    stalled for 90 s read `stalled 2m`)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def last_logged(run: RunDir) -> tuple[tuple[int, float] | None, dict[str, float]]:
    """The last training loss logged, as (step, loss), and a preference run's rewards: the
    last training step's (train_accuracy, train_margin) and the last evaluation's
    (eval_accuracy, eval_margin), those it recorded; empty for a supervised run. Read from the
    end of metrics.jsonl, as far back as they are: a long run logs thousands of lines."""
    loss: tuple[int, float] | None = None
    rewards: dict[str, float] = {}
    preference = False
    for record in run.records_from_end():
        for split, prefix in (("train", ""), ("eval", "eval_")):
            for what in ("accuracy", "margin"):
                value = number(record.get(f"{prefix}rewards_{what}"))
                if value is not None:
                    rewards.setdefault(f"{split}_{what}", value)
        if loss is None and (value := number(record.get("loss"))) is not None:
            loss, preference = (record["step"], value), "rewards_accuracy" in record
        if loss is not None and (not preference or "eval_accuracy" in rewards):
            break
    return loss, rewards


def _rewards_text(rewards: dict[str, float]) -> str:
    """'acc 62%, margin 0.41' of the eval pairs where evaluated, else of the training pairs."""
    split = "eval" if "eval_accuracy" in rewards else "train"
    if f"{split}_accuracy" not in rewards:
        return "-"
    return f"acc {rewards[f'{split}_accuracy']:.0%} margin {rewards[f'{split}_margin']:.3g}"


def runs_table(runs: list[RunDir], base: Path) -> str:
    """One line per run: where, state, step of total, last loss logged (with its step where the
    run is past it), recorded best eval, a preference run's reward accuracy and margin, age. A
    run removed while it is read is left out."""
    head = (
        f"{'run':<44} {'state':<13} {'step':>11} {'loss':>11} {'best eval@step':>26} "
        f"{'rewards':>24} {'age':>5}"
    )
    lines = [head]
    for run in runs:
        with contextlib.suppress(FileNotFoundError):
            if is_run_dir(run.path):
                lines.append(_run_line(run, base))
    return "\n".join(lines)


def _run_line(run: RunDir, base: Path) -> str:
    status = run.status()
    state, _ = run.effective_state()
    if state == STALLED:  # and for how long: the heartbeat's age
        state = f"{state} {_duration(run.seconds_since_heartbeat() or 0.0)}"
    logged, rewards = last_logged(run)
    where = os.path.relpath(run.path, base)
    step = f"{status.step or 0}/{status.total_steps or '-'}"
    loss = "-"
    if logged is not None:  # with the step it was logged at, where the run is past it
        loss = f"{logged[1]:.4f}" + (f"@{logged[0]}" if logged[0] != status.step else "")
    best = (
        "-"
        if status.best is None
        else (f"{status.best['metric']}={status.best['value']:.4g}@{status.best['step']}")
    )
    return (
        f"{where:<44} {state:<13} {step:>11} {loss:>11} {best:>26} {_rewards_text(rewards):>24} "
        f"{_age(status.updated_at):>5}"
    )


class LogReader:
    """Reads a run's train.log from where the last read ended (the log may not exist yet)."""

    def __init__(self, run: RunDir) -> None:
        self.run, self.position = run, 0

    def read(self) -> str:
        """The text appended since the last read ("" if none)."""
        log_file = self.run.path / LOG_FILE
        if not log_file.exists():
            return ""
        with open(log_file) as f:
            f.seek(self.position)
            text = f.read()
            self.position = f.tell()
        return text

    def ended(self) -> bool:
        """Whether the run is over, so that nothing more will be written (also where its
        status.json cannot be read and no process of it is left)."""
        return self.run.effective_state()[0] in FINAL_STATES or _unreadable(self.run)


def request_stop(run: RunDir, *, key: str = "RUN", sig: int = signal.SIGTERM) -> int:
    """Signals the process that trains `run` (SIGTERM: save a checkpoint and end as cancelled);
    a UserError under `key` if the run is over, elsewhere or recorded no process. Its pid."""
    status = run.status()
    state, why = run.effective_state()
    if state in (*FINAL_STATES, STOPPING):
        raise UserError(
            key, str(run.path), f"the run is already {state}" + (f" ({why})" if why else "")
        )
    if status.host != socket.gethostname():
        raise UserError(
            key, str(run.path), f"the run is on host {status.host}; run `runner stop` there"
        )
    pid = status.launcher_pid
    if pid is None:
        raise UserError(key, str(run.path), "the run recorded no process to signal")
    if sig == signal.SIGKILL:
        # The launcher and each process under it: the workers forked on a CPU lead sessions
        # of their own, which a kill of the launcher's group missed (they saved a checkpoint
        # as it died, and recorded that over the kill).
        for process in [*run_processes(run), pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process, sig)
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)  # and what shares its group (a loader's workers)
    else:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise UserError(key, str(run.path), f"its process {pid} is gone") from None
        except PermissionError:
            raise UserError(
                key,
                str(run.path),
                f"its process {pid} is another user's; only that user (or root) can stop it",
            ) from None
    if state == STALLED:
        # A stopped process handles SIGTERM only once continued; a hung one may never.
        for stopped in stopped_processes(run):
            os.kill(stopped, signal.SIGCONT)
    return pid


def sweep_it_ends(run: RunDir) -> Path | None:
    """The sweep that a stop of `run` ends too: a sequential sweep's, whose own process trains
    its jobs one after another, while that process runs; else None (a parallel sweep's job has
    a process of its own, and so has a job resumed alone once its sweep's process is gone)."""
    sweep = sequential_sweep_of(run)
    if sweep is None or lock_held(sweep, SWEEP_LOCK_FILE) is False:
        return None
    return sweep


def sequential_sweep_of(run: RunDir) -> Path | None:
    """The sweep directory `run` is a job of, where that sweep's jobs run one after another in
    its own process (its launcher is not joblib's); else None."""
    record = run.path.parent / "multirun.yaml"  # Hydra's record of the sweep, its launcher's
    try:
        hydra = (yaml.safe_load(record.read_text()) or {}).get("hydra") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    launcher = str((hydra.get("launcher") or {}).get("_target_", ""))
    return None if "joblib" in launcher else run.path.parent


def stopped_processes(run: RunDir) -> list[int]:
    """The run's processes on this machine that are stopped (SIGSTOP, Ctrl-Z): its launcher,
    the processes it started, and the one that last wrote its status."""
    return [pid for pid in run_processes(run) if pid_stopped(pid)]


def run_processes(run: RunDir) -> list[int]:
    """The run's processes on this machine: its launcher, the processes it started (and
    theirs), and the one that last wrote its status."""
    status = run.status()
    found: list[int] = []
    todo = [p for p in (status.launcher_pid, status.pid) if p is not None]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(child) for child in task.read_text().split())
    return sorted(found)


def stall_note(run: RunDir, why: str | None, continued: list[int], timeout: float) -> str:
    """What `runner stop` can and cannot do for a stalled run."""
    latest = run.latest_checkpoint()
    without = (
        f"`kill -9 {run.status().launcher_pid}` ends it without a checkpoint (a resume continues "
        f"from {latest or 'the start'})"
    )
    if continued:
        listed = " ".join(map(str, continued))
        return (
            f"the run was stalled ({why}); continued process {listed} so that it saves and stops; "
            f"if it does not within {timeout:.0f} s, {without}"
        )
    return (
        f"the run is stalled ({why}): a hung process may never answer; if it has not stopped "
        f"within {timeout:.0f} s, {without}"
    )


def wait_until_final(run: RunDir, timeout: float | None, interval: float = 0.5) -> str:
    """The run's state once it is final (completed, failed, cancelled), or its state when
    `timeout` seconds have passed (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        state, _ = run.effective_state()
        if state in FINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
            return state
        time.sleep(interval)


def wait_for_orphans(run: RunDir, timeout: float = ORPHANS_WAIT_S) -> None:
    """Where the run's launcher is gone and its workers are saving (`stopping`), waits, saying
    so on one line, until they have ended the run and let go of its lock, or `timeout` passes."""
    state, why = run.effective_state()
    if state != STOPPING:
        return
    print(
        f"{run.path}: waiting up to {timeout:.0f} s for the run to end ({why})",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + timeout
    while lock_held(run.path) and time.monotonic() < deadline:
        time.sleep(0.1)


def check_recipe_whole(run: RunDir) -> None:
    """A UserError naming the keys the run's recipe.yaml lacks of those its manifest.json
    recorded as it started: cut short (a copy stopped midway, a full disk) or removed, it read
    with those keys at their defaults. Read before the recipe is: resume and repro go on
    with it."""
    from runner.config.schema import recipe_as_written
    from runner.rundir.manifest import missing_config

    missing = missing_config(run, recipe_as_written(run.recipe_path))
    if missing:
        named = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise UserError(
            str(run.recipe_path),
            None,
            f"lacks {len(missing)} of the keys the run started with ({named}): cut short (a "
            "copy stopped midway, a full disk) or removed; put them back as manifest.json's "
            "`config` recorded them, or start a new run from its checkpoint (runner train "
            f"{pasteable('load_checkpoint.path', str(run.path))} ...)",
        )


def check_recipe_as_recorded(run: RunDir) -> None:
    """runner resume goes on with the recipe the run started with: one edited since (a new lr,
    which the checkpoint's optimizer state overrides) would be recorded as trained, and never
    trained with. Refused by the keys that differ, in the file as written (a key an older
    runner did not write is in neither), or that it lacks (check_recipe_whole)."""
    from runner.config.schema import recipe_as_written
    from runner.rundir.manifest import changed_config

    check_recipe_whole(run)
    changed = changed_config(run, recipe_as_written(run.recipe_path))
    if changed:
        raise UserError(
            str(run.recipe_path),
            None,
            f"edited since the run started ({'; '.join(changed)}, where manifest.json recorded "
            "its start): runner resume goes on with the recipe a run started with; put it back, "
            "or start a new run from its checkpoint with the new settings (runner train "
            f"load_checkpoint.path={run.path} ...)",
        )


def check_resumable(run: RunDir, *, key: str = "RUN") -> None:
    """A UserError under `key` unless `run` ended cancelled or failed (so it can go on) with the
    recipe it started with; a run whose workers are still saving is waited for
    (wait_for_orphans)."""
    wait_for_orphans(run)
    state, why = run.effective_state()
    if state == "completed":
        raise UserError(
            key,
            str(run.path),
            "the run is already completed; to train on from its last checkpoint, start a new "
            "run from it: runner train "
            f"{pasteable('load_checkpoint.path', str(run.path))} max_steps=<more>",
        )
    if state == STOPPING:
        raise UserError(
            key,
            str(run.path),
            f"the run is stopping ({why}); resume it once `runner runs` shows it has ended",
        )
    if state not in FINAL_STATES:
        raise UserError(
            key, str(run.path), f"the run is still {state}; `runner stop {run.path}` first"
        )
    if run.recipe_path.is_file():  # else the resume itself names what the run lacks
        check_recipe_as_recorded(run)
