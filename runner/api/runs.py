"""Training through runner.api: `launch` and `sweep` start `runner train` detached, and a Run or
Sweep is a handle on the directory it writes (docs/run-directory.md), read through runner.rundir
and runner.job.lifecycle as `runner runs | logs | stop | resume` read it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from runner.api.configs import compose, compose_sweep, environment, listed, working_dir
from runner.api.processes import (
    console_of,
    last_error,
    missing,
    new_dir,
    new_name,
    printed_error,
    start,
    wait_gone,
)
from runner.config.fields import override_key
from runner.config.schema import typed
from runner.errors import UserError
from runner.job import lifecycle
from runner.job.sweep_start import check_no_sweep_running
from runner.paths import override, user_path
from runner.rundir import (
    FINAL_STATES,
    SUMMARY_JSON,
    SWEEP_LOCK_FILE,
    RunDir,
    Status,
    is_run_dir,
    is_sweep_dir,
    lock_held,
)


def launch(
    overrides: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Any = None
) -> Run:
    """Starts `runner train OVERRIDES` in a new directory under runtime.output_root and returns
    at once; the Run reports how it goes. A bad override or option, or a value of a key outside
    the groups, raises here; what the run's own checks find (a group's value such as
    optimizer.lr=-1, a missing file, a bad record) ends it `failed`, with the message, in
    seconds. api.validate checks it all first."""
    overrides, env, base = listed(overrides), environment(env), working_dir(cwd)
    resumes = [o for o in overrides if o.startswith("resume=")]
    if resumes:
        raise UserError(
            "resume",
            resumes[0].removeprefix("resume="),
            "launch starts a new run; continue one with api.Run(RUN).resume()",
        )
    named = [o for o in overrides if override_key(o) == "hydra.run.dir"]
    if named:  # the launch's own names the run's directory: the user's was dropped unseen
        raise UserError(
            "hydra.run.dir",
            named[0].partition("=")[2],
            "launch makes a new directory under runtime.output_root; give runtime.output_root "
            "(or cwd=), or resume a run of that directory with api.Run(RUN).resume()",
        )
    path = new_dir(base / user_path(typed(compose(overrides)).runtime.output_root))
    args = ["train", *overrides, override("hydra.run.dir", str(path))]
    return Run(path, _process=start(args, console_of(path), base, env), _cwd=base)


def runs(*dirs: str | os.PathLike[str]) -> list[Run]:
    """The runs under `dirs` (default ./outputs and ./multirun), newest first: those `runner
    runs` lists. A directory that cannot be read, or a run removed as it is read, is passed
    over; a dir that is no directory is a UserError."""
    found = []
    for run in lifecycle.find_runs(lifecycle.run_roots([user_path(d) for d in dirs])):
        try:
            found.append(Run(run.path))
        except UserError:
            continue  # removed since it was found
    return found


class Run:
    """A training run, by its directory: launched here, or any run directory (`Run(path)`; a
    path that holds none raises a UserError, a run that is starting is waited for)."""

    def __init__(
        self, path: str | os.PathLike[str], *, _process: Any = None, _cwd: Path | None = None
    ) -> None:
        self.path = user_path(path).resolve()
        self.dir = RunDir(self.path)
        if _process is None:
            lifecycle.run_dir_at(self.path, key="path", readable=False)
        self._process: subprocess.Popen[bytes] | None = _process
        # The status a resume started from, until the resumed process writes its own.
        self._resumed_from: str | None = None
        # Where its command ran: relative paths in its config are read from there.
        self._cwd = _cwd or Path.cwd()

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    def status(self) -> Status:
        """status.json as runner.rundir.Status, with the state `runner runs` shows: `failed`
        when its processes are gone without saying so, `stopping` while its workers outlive
        their launcher, `stalled` while its processes live but its heartbeat is stale (stopped
        or hung; `error` says for how long) (RunDir.effective_state). A run launched here
        reads `created` until it writes its status, and `failed`, with the error it printed, if
        it was refused."""
        status = self.dir.status()
        resuming = self._resumed_from is not None and status.updated_at == self._resumed_from
        if resuming and self._process is not None and self._process.poll() is None:
            # Not the attempt before's end (cancelled, failed): a poller would stop at it.
            return dataclasses.replace(status, state="created", error=None)
        if status.state == "unknown" and self._process is not None:
            if self._process.poll() is None:
                return Status(state="created")  # resolving its recipe, checking its data
            error = last_error(console_of(self.path)) or f"exit code {self._process.returncode}"
            return Status(state="failed", error=error)
        state, why = self.dir.effective_state()
        if state != status.state:
            status = dataclasses.replace(status, state=state, error=why)
        return status

    def done(self) -> bool:
        """Whether the run has ended (and the process started here has exited)."""
        if self._process is not None and self._process.poll() is None:
            return False
        return self.status().state in FINAL_STATES

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> Status:
        """The final status once the run ends; TimeoutError after `timeout` seconds."""
        _poll(self.done, timeout, interval, lambda: f"{self.path} is still {self.status().state}")
        return self.status()

    def metrics(self) -> list[dict[str, Any]]:
        """The lines of metrics.jsonl: training metrics and evaluations, by step."""
        return self.dir.read_metrics()

    def logs(self, follow: bool = False, interval: float = 0.5) -> LogStream:
        """train.log's lines; with `follow`, new lines as they come, until the run ends. Iterate
        it with `for` or `async for`."""
        return LogStream(lifecycle.LogReader(self.dir), self.done, follow, interval)

    def console(self) -> str:
        """What the processes started here printed (the summary, an `error:` line)."""
        path = console_of(self.path)
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, save_checkpoint: bool = True, timeout: float | None = 300.0) -> Status:
        """`runner stop`: SIGTERM, so the run saves a checkpoint and ends `cancelled`.

        save_checkpoint=False kills it at once (SIGKILL to its process group: the launcher and,
        where they share it, its workers), so it loses the steps since its last checkpoint,
        and records it `cancelled` with the step it had logged. A job of a sequential sweep
        runs in the sweep's own process, so the sweep ends with it (its summary says so), as
        with `runner stop`.
        """
        self._started(timeout)
        self._check_recorded("stop")
        if save_checkpoint:
            lifecycle.request_stop(self.dir, key="run")
            return self.wait(timeout)
        pid = lifecycle.request_stop(self.dir, key="run", sig=signal.SIGKILL)
        step = self.dir.status().step
        wait_gone(pid, self._process)
        latest = self.dir.latest_checkpoint()
        then = f"resume continues from {latest}" if latest else "a resume starts from step 0"
        self.dir.write_status(
            "cancelled", error=f"killed without a checkpoint at step {step}; {then}"
        )
        if lifecycle.sequential_sweep_of(self.dir) is not None:
            from runner.job.sweep import refresh_sweep_of

            # The kill ended the sweep's own process, where its jobs run one after another (or
            # the resume that trained the job alone), before it summed up this job: the summary
            # says where its jobs stand.
            refresh_sweep_of(self.path)
        return self.status()

    def _started(self, timeout: float | None) -> None:
        """A run launched (or resumed) here, waited for until its process records its status
        (its pid, its host), as `runner stop` waits: a stop in its first seconds found no status
        and was refused ("the run is on host None"), and the run trained to its end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._process is not None and self._process.poll() is None:
            status = self.dir.status()
            # A resume's process records its own; the status before it is the attempt before's.
            if status.launcher_pid is not None and status.updated_at != self._resumed_from:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} has not recorded its status yet")
            time.sleep(0.1)

    def _check_recorded(self, doing: str) -> None:
        """A run with no status.json has nothing to stop or resume (`doing`): a launch of this
        handle's that its own checks refused (its directory went with it, its error is in
        the console), or a directory removed or never a run's. Its status read `unknown`, and
        stop() said "the run is on host None", resume() "`runner stop RUN` first"."""
        if is_run_dir(self.path):
            return
        status = self.status()  # `failed`, with the error it printed, if refused here
        if status.state == "failed" and status.error:
            raise UserError(
                "run",
                str(self.path),
                f"its launch was refused ({status.error}); nothing trained, so nothing to "
                f"{doing}: fix that and launch it again",
            )
        lifecycle.run_dir_at(self.path, key="run", readable=False)  # says what is there

    def resume(self, checkpoint: str | os.PathLike[str] | None = None) -> Run:
        """`runner resume`: continues a cancelled or failed run from its latest whole checkpoint
        (`checkpoint`, when given, must be that one: training goes on from the newest state)."""
        if self._process is not None and self._process.poll() is None:
            # A second resume (a retry, a double click) read the status the first had not yet
            # replaced, started a process the lock refused, and left this handle following it.
            raise UserError(
                "run",
                str(self.path),
                f"process {self._process.pid} of this handle trains it still (a resume under "
                "way); wait() for it, or stop() it and resume again",
            )
        self._check_recorded("resume")
        lifecycle.check_resumable(self.dir, key="run")
        if checkpoint is not None:
            latest = self.dir.latest_checkpoint()
            if latest is None or Path(checkpoint).resolve() != latest.resolve():
                raise UserError(
                    "checkpoint",
                    str(checkpoint),
                    f"a run resumes from its latest whole checkpoint ({latest}); to go on from "
                    "an earlier one, train a new run from it (model.source=<that checkpoint>)",
                )
        args = ["train", f"resume={self.path}"]
        self._resumed_from = self.dir.status().updated_at
        self._process = start(args, console_of(self.path), self._cwd, None)
        return self


class LogStream:
    """The lines of a run's log, read as they are written: an iterator and an async iterator."""

    def __init__(
        self,
        reader: lifecycle.LogReader,
        ended: Callable[[], bool],
        follow: bool,
        interval: float,
    ) -> None:
        self.reader, self.ended, self.follow, self.interval = reader, ended, follow, interval
        self._partial = ""

    def _lines(self, last: bool) -> list[str]:
        lines = (self._partial + self.reader.read()).split("\n")
        # The text after the last newline: a line still being written, or "" (the log's end).
        self._partial = lines.pop()
        if last and self._partial:
            lines.append(self._partial)
        return lines

    def __iter__(self) -> Iterator[str]:
        while True:
            last = not self.follow or self.ended()
            yield from self._lines(last)
            if last:
                return
            time.sleep(self.interval)

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            last = not self.follow or await asyncio.to_thread(self.ended)
            for line in self._lines(last):
                yield line
            if last:
                return
            await asyncio.sleep(self.interval)


def sweep(
    overrides: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Any = None
) -> Sweep:
    """`runner train -m OVERRIDES` (e.g. optimizer.lr=1e-3,2e-3) in a new sweep directory under
    runtime.multirun_root, or in the hydra.sweep.dir they give (read from `cwd`), as the CLI
    runs it. Returns once the sweep's process has checked the sweep (each swept value in a job
    of the grid, from `cwd`) and taken its directory: a refusal raises the UserError it
    printed, and what was made for it is removed."""
    overrides, env, base = listed(overrides), environment(env), working_dir(cwd)
    config = compose_sweep(overrides)  # a bad override or option, refused here at once
    named = [o for o in overrides if override_key(o) == "hydra.sweep.dir"]
    if named:  # the user's own, as `runner train -m` takes it (the one appended here won)
        path = (base / user_path(config.hydra.sweep.dir)).resolve()
        overrides = [o for o in overrides if o not in named]
    else:
        path = new_name(base / user_path(config.runtime.multirun_root)).resolve()
    # A sweep there that still runs holds the lock that the wait below reads as this one's.
    check_no_sweep_running(path, "hydra.sweep.dir", str(path))
    made, console = missing(path), console_of(path)
    path.mkdir(parents=True, exist_ok=True)
    printed = console.stat().st_size if console.exists() else None  # a sweep's there before
    if lock_held(path, SWEEP_LOCK_FILE) is False:  # an ended sweep's there before
        (path / SWEEP_LOCK_FILE).unlink()
    args = ["train", "-m", *overrides, override("hydra.sweep.dir", str(path))]
    process = start(args, console, base, env)
    # The sweep's process takes its lock once its checks pass (runner.job.sweep.SweepSummary).
    while not (path / SWEEP_LOCK_FILE).exists() and process.poll() is None:
        time.sleep(0.1)
    error = None if (path / SWEEP_LOCK_FILE).exists() else last_error(console, printed or 0)
    if error is not None:
        if printed is None:
            console.unlink(missing_ok=True)
        else:
            os.truncate(console, printed)  # as the sweep there before left it
        for directory in made:
            with contextlib.suppress(OSError):  # one it wrote into stays
                directory.rmdir()
        raise printed_error(error, "runner train -m")
    return Sweep(path, _process=process)


class Sweep:
    """A sweep, by its directory: one Run per job, and the summary runner.job.sweep writes."""

    def __init__(self, path: str | os.PathLike[str], *, _process: Any = None) -> None:
        self.path = user_path(path).resolve()
        self._process: subprocess.Popen[bytes] | None = _process
        if _process is None and not is_sweep_dir(self.path):
            found = "not a sweep directory" if self.path.exists() else "no such directory"
            raise UserError(
                "path",
                str(path),
                f"{found} (no multirun.yaml or summary.json); `runner runs` lists the runs here",
            )

    def runs(self) -> list[Run]:
        """One Run per job of the sweep, none before its directory exists."""
        from runner.rundir import sweep_runs

        return [Run(job.path) for job in sweep_runs(self.path)] if self.path.is_dir() else []

    def console(self) -> str:
        """What the sweep's process printed (its summary table at the end, an `error:` line):
        "" before it printed anything, or for a sweep not started through runner.api, whose
        output went to its own terminal."""
        path = console_of(self.path)
        return path.read_text(errors="replace") if path.exists() else ""

    def summary(self) -> dict[str, Any] | None:
        """summary.json (jobs, their state and metric, the best), once a job has ended."""
        path = self.path / SUMMARY_JSON
        return json.loads(path.read_text()) if path.is_file() else None

    def best(self) -> Run | None:
        """The best job by the sweep's objective (runner.rundir.best_run), if any."""
        best = (self.summary() or {}).get("best")
        # By its job's name under this sweep: its run_dir is as the sweep was given (relative
        # to the sweep's own directory then), and a sweep copied elsewhere holds its own jobs.
        return Run(self.path / best["job"]) if best else None

    def done(self) -> bool:
        """Whether the sweep has ended: its process (this handle's, or the one that holds the
        sweep directory's lock) is gone and every job it started has ended."""
        if self._process is not None and self._process.poll() is None:
            return False
        if lock_held(self.path, SWEEP_LOCK_FILE):
            return False
        return all(run.done() for run in self.runs())

    def wait(self, timeout: float | None = None, interval: float = 0.5) -> dict[str, Any] | None:
        """The summary once the sweep has ended (done()); TimeoutError after `timeout` s. A
        handle on a sweep's directory (api.Sweep(path)) waits for it as the one api.sweep
        returned does: it returned at once, before the sweep's summary."""
        _poll(self.done, timeout, interval, lambda: f"sweep {self.path} is still running")
        return self.summary()


def _poll(
    done: Callable[[], bool], timeout: float | None, interval: float, still: Callable[[], str]
) -> None:
    """Returns once `done()`, asking every `interval` seconds; after `timeout` seconds (None:
    never), TimeoutError saying `still()`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(still())
        time.sleep(interval)
