"""runner.api: the `runner` commands as a Python API, for services that put runner behind their
own front (a job service, a notebook, a scheduler).

Every function runs the code the CLI runs: `validate` and `estimate` compose conf/ in this
process and call runner.job.preflight; `launch`, `sweep` and `deploy` start `python -m runner ...`
as a detached process in a session of its own, so that training outlives the caller; a `Run` is
a handle on a run directory (the contract docs/run-directory.md gives) and reads it through
runner.rundir and runner.job.lifecycle, as `runner runs | logs | stop | resume` do.

    from runner import api

    problems = api.validate(["max_steps=100"])     # [] or the UserErrors, not raised
    run = api.launch(["max_steps=100"])            # returns at once
    for line in run.logs(follow=True): print(line)
    status = run.wait()                            # runner.rundir.Status, state `completed`

The console output of each process started here (what `runner train` prints, its `error:` line
included) goes to a file beside its directory: `.<name>.console.log`. It outlives a launch whose
run directory was removed because its config was refused, and that is where the error is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from runner.config import interpolations
from runner.config.fields import override_key
from runner.config.schema import typed
from runner.errors import UserError
from runner.job import lifecycle
from runner.paths import CONF_DIR
from runner.rundir import (
    FINAL_STATES,
    STALLED,
    STATES,
    STOPPING,
    SUMMARY_JSON,
    RunDir,
    Status,
    is_sweep_dir,
)

if TYPE_CHECKING:
    from runner.job.preflight import Estimate

_HYDRA = threading.Lock()  # Hydra's compose API keeps global state
_URL_LINE = re.compile(r"OpenAI-compatible API at (http://\S+)")
_CONFIG_GROUPS = ("model", "dataset", "method", "dtype", "compute", "optimizer", "loss")


@dataclass(frozen=True)
class Capabilities:
    """What this installation of runner offers: the options of each config group (conf/), the
    deploy engines, the trackers and the lifecycle states a run goes through."""

    models: tuple[str, ...]
    datasets: tuple[str, ...]
    methods: tuple[str, ...]
    dtypes: tuple[str, ...]
    compute: tuple[str, ...]
    optimizers: tuple[str, ...]
    losses: tuple[str, ...]
    engines: tuple[str, ...]
    loggers: tuple[str, ...]
    states: tuple[str, ...]


def capabilities() -> Capabilities:
    """The options this installation offers, read from conf/ and the code that serves them."""
    from runner.config.loggers import TRACKERS
    from runner.deploy.serve import ENGINES

    def options(group: str) -> tuple[str, ...]:
        """The options of a config group: its YAML files' names."""
        return tuple(sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml")))

    groups = dict(zip(_CONFIG_GROUPS, map(options, _CONFIG_GROUPS), strict=True))
    return Capabilities(
        models=groups["model"],
        datasets=groups["dataset"],
        methods=groups["method"],
        dtypes=groups["dtype"],
        compute=groups["compute"],
        optimizers=groups["optimizer"],
        losses=groups["loss"],
        engines=tuple(ENGINES),
        loggers=tuple(TRACKERS),
        states=(*STATES, STOPPING, STALLED),
    )


def compose(overrides: Sequence[str], config_name: str = "train") -> DictConfig:
    """conf/`config_name` composed with `overrides`, as `runner train` composes it; a bad
    override or option raises the UserError the CLI would print."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.config.hydra_errors import as_user_error

    interpolations.register()
    with _HYDRA, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return hydra_compose(config_name, overrides=_listed(overrides))
        except Exception as err:  # noqa: BLE001 - recast as the CLI does, re-raised otherwise
            user_error = as_user_error(err, config_name)
            if user_error is None:
                raise
            raise user_error from None


def _listed(overrides: Sequence[str]) -> list[str]:
    """`overrides` as a list of strings; one string given for the list was read a character at
    a time ("override='m': Error parsing override")."""
    if isinstance(overrides, str | bytes) or not all(isinstance(o, str) for o in overrides):
        raise UserError("overrides", overrides, "give a list of strings, e.g. ['max_steps=4']")
    return list(overrides)


def _environment(env: Any) -> dict[str, str] | None:
    """`env` (the process's environment, None for this one's) as a dict of strings, checked
    before a directory is made (a bad one raised a bare TypeError from Popen, after it). Its
    values are never shown: they may hold a secret."""
    if env is None:
        return None
    if not isinstance(env, Mapping):
        raise UserError(
            "env",
            None,
            f"a {type(env).__name__}; give a mapping of names to strings, e.g. "
            "{**os.environ, 'A': '1'}",
        )
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise UserError(
                f"env[{name!r}]",
                None,
                f"a {type(value).__name__}; give names and values as strings",
            )
    return dict(env)


def validate(overrides: Sequence[str]) -> list[UserError]:
    """The problems `runner validate` would report for `overrides` (config, weights, tokenizer,
    every data record), as UserErrors, not raised: [] when it would train. The checks build on
    one another, so the list holds the first problem found."""
    from runner.job.preflight import check

    try:
        check(compose(overrides), list(overrides))
    except UserError as err:
        return [err]
    return []


def estimate(overrides: Sequence[str]) -> Estimate:
    """`runner estimate`: parameters, memory per device and tokens per epoch (raises a
    UserError for a bad config)."""
    from runner.job.preflight import estimated

    return estimated(compose(overrides), list(overrides))[1]


def launch(
    overrides: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Any = None
) -> Run:
    """Starts `runner train OVERRIDES` in a new directory under runtime.output_root and returns
    at once; the Run reports how it goes. A bad override, option or value raises here; what
    training finds later (a missing file, a bad record) ends the run `failed`, with the
    message."""
    overrides, env = _listed(overrides), _environment(env)
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
    base = Path(cwd or Path.cwd())
    path = _new_dir(base / str(typed(compose(overrides)).runtime.output_root))
    args = ["train", *overrides, f"hydra.run.dir={path}"]
    return Run(path, _process=_start(args, _console(path), base, env), _cwd=base)


class Run:
    """A training run, by its directory: launched here, or any run directory (`Run(path)`; a
    path that holds none raises a UserError, a run that is starting is waited for)."""

    def __init__(
        self, path: str | os.PathLike[str], *, _process: Any = None, _cwd: Path | None = None
    ) -> None:
        self.path = Path(path).resolve()
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
            error = _last_error(_console(self.path)) or f"exit code {self._process.returncode}"
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
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} is still {self.status().state}")
            time.sleep(interval)
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
        path = _console(self.path)
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, save_checkpoint: bool = True, timeout: float | None = 300.0) -> Status:
        """`runner stop`: SIGTERM, so the run saves a checkpoint and ends `cancelled`.

        save_checkpoint=False kills it at once (SIGKILL to its process group: the launcher and,
        where they share it, its workers), so it loses the steps since its last checkpoint,
        and records it `cancelled` with the step it had logged.
        """
        self._started(timeout)
        if save_checkpoint:
            lifecycle.request_stop(self.dir, key="run")
            return self.wait(timeout)
        pid = lifecycle.request_stop(self.dir, key="run", sig=signal.SIGKILL)
        step = self.dir.status().step
        _wait_gone(pid, self._process)
        latest = self.dir.latest_checkpoint()
        then = f"resume continues from {latest}" if latest else "a resume starts from step 0"
        self.dir.write_status(
            "cancelled", error=f"killed without a checkpoint at step {step}; {then}"
        )
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
        self._process = _start(args, _console(self.path), self._cwd, None)
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
    runtime.multirun_root; returns at once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides, env = _listed(overrides), _environment(env)
    parsed = OverridesParser.create().parse_overrides(overrides)
    plain = [line for line, o in zip(overrides, parsed, strict=True) if not o.is_sweep_override()]
    base = Path(cwd or Path.cwd())
    path = _new_dir(base / str(typed(compose(plain)).runtime.multirun_root))
    args = ["train", "-m", *overrides, f"hydra.sweep.dir={path}"]
    return Sweep(path, _process=_start(args, _console(path), base, env))


class Sweep:
    """A sweep, by its directory: one Run per job, and the summary runner.job.sweep writes."""

    def __init__(self, path: str | os.PathLike[str], *, _process: Any = None) -> None:
        self.path = Path(path).resolve()
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

    def summary(self) -> dict[str, Any] | None:
        """summary.json (jobs, their state and metric, the best), once a job has ended."""
        path = self.path / SUMMARY_JSON
        return json.loads(path.read_text()) if path.is_file() else None

    def best(self) -> Run | None:
        """The best job by the sweep's objective (runner.rundir.best_run), if any."""
        best = (self.summary() or {}).get("best")
        return Run(best["run_dir"]) if best else None

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The summary once the sweep process has ended; TimeoutError after `timeout` s."""
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"sweep {self.path} is still running") from None
        return self.summary()


def deploy(
    overrides: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Any = None
) -> Deployment:
    """`runner deploy OVERRIDES` (checkpoint=<run, checkpoint or sweep dir>, port=0 for any free
    port); returns at once: Deployment.wait_ready() gives its URL."""
    overrides, env = _listed(overrides), _environment(env)
    compose(overrides, "deploy")
    handle, name = tempfile.mkstemp(prefix="runner-deploy-", suffix=".log")
    os.close(handle)
    console, base = Path(name), Path(cwd or Path.cwd())
    return Deployment(_start(["deploy", *overrides], console, base, env), console)


class Deployment:
    """A running `runner deploy`: its OpenAI-compatible URL once ready, and stop()."""

    def __init__(self, process: subprocess.Popen[bytes], console: Path) -> None:
        self.process, self.console_path = process, console
        self.url: str | None = None
        self._ended_console: str | None = None

    def console(self) -> str:
        """What the server process has printed so far (all it printed, once it has ended)."""
        if self._ended_console is not None:
            return self._ended_console
        return self.console_path.read_text(errors="replace") if self.console_path.exists() else ""

    def _ended(self) -> None:
        """The server has ended: its console is kept here and its temporary file removed (one
        was left in /tmp for every deployment)."""
        if self._ended_console is None:
            self._ended_console = self.console()
            self.console_path.unlink(missing_ok=True)

    def wait_ready(self, timeout: float = 300.0) -> str:
        """The base URL (http://host:port/v1) once the models are loaded and it serves; a
        UserError with the server's message if it ended instead."""
        deadline = time.monotonic() + timeout
        while self.url is None:
            found = _URL_LINE.search(self.console())
            if found:
                self.url = found.group(1)
            elif self.process.poll() is not None:
                error = _last_error(self.console_path) or f"exit code {self.process.returncode}"
                self._ended()
                raise UserError("deploy", "ended", error)
            elif time.monotonic() > deadline:
                raise TimeoutError(f"runner deploy not ready after {timeout:.0f} s")
            else:
                time.sleep(0.2)
        _wait_health(self.url.removesuffix("/v1") + "/health", deadline)
        return self.url

    def stop(self, timeout: float = 60.0) -> int:
        """Drains and stops the server (SIGTERM); its exit code. uvicorn raises the signal again
        once it has shut down cleanly, so a clean stop is -SIGTERM (-15), as for `kill`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        self._ended()
        return code


def _new_dir(root: Path) -> Path:
    """A directory under `root` named by date and time, made here so no other launch takes it."""
    now = datetime.now()
    path = root / now.strftime("%Y-%m-%d") / f"{now:%H-%M-%S}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    return path.resolve()


def _console(path: Path) -> Path:
    return path.with_name(f".{path.name}.console.log")


def _start(
    args: list[str], console: Path, cwd: Path, env: dict[str, str] | None
) -> subprocess.Popen[bytes]:
    """`python -m runner ARGS` detached: its own session, output appended to `console`."""
    with open(console, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "runner", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _last_error(console: Path) -> str | None:
    """The message of the last `error: ...` line a runner command printed."""
    if not console.exists():
        return None
    errors = [line for line in console.read_text().splitlines() if line.startswith("error: ")]
    return errors[-1].removeprefix("error: ") if errors else None


def _wait_gone(pid: int, process: subprocess.Popen[bytes] | None) -> None:
    """Until process `pid` has exited (reaping it when it was started here)."""
    while True:
        if process is not None and process.pid == pid:
            process.wait()
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _wait_health(url: str, deadline: float) -> None:
    import urllib.request

    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} does not answer") from None
        time.sleep(0.2)
