"""Runs you can list, follow, stop and resume; a dead process never shows as running."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runner import api
from runner.job import stops
from runner.paths import SAMPLE_DATA_DIR
from runner.rundir import RunDir, RunLocked, lock_held, run_lock
from tests.conftest import QUICK, sweep_lock_held

LONG_JOB = [
    *QUICK,
    "max_steps=100",
    "runtime.save_every_n_steps=5",
    "runtime.log_every_n_steps=1",
    "dataset.eval_samples=0",
]


def start_run(env: dict[str, str], run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`runner train` of LONG_JOB, with `overrides` after it (Hydra keeps the last)."""
    command = [sys.executable, "-m", "runner", "train", *LONG_JOB, *overrides]
    return subprocess.Popen(
        [*command, f"hydra.run.dir={run_dir}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


# A guard against a hang, not a timing: under `pytest -n 2` on a loaded machine the first
# checkpoint of a run has taken over 180 s.
def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        if list((run_dir / "checkpoints").glob("step_*")):
            return
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


def state_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def test_a_killed_run_shows_as_failed(runner_cli, hermetic_env, tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / "killed"
    proc = start_run(hermetic_env, run_dir)
    wait_for_checkpoint(run_dir, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert state_of(run_dir)["state"] in ("running", "checkpointing")  # as the dead process left it
    listing = runner_cli("runs", str(tmp_path / "outputs"))
    assert listing.returncode == 0
    (line,) = [ln for ln in listing.stdout.splitlines() if "killed" in ln]
    assert line.split()[1] == "failed", listing.stdout
    logs = runner_cli("logs", str(run_dir))
    assert "step 1/100 loss" in logs.stdout


@pytest.mark.long  # signalled mid-run
def test_a_run_outlives_its_console_and_saves_on_a_hangup(hermetic_env, tmp_path: Path) -> None:
    """`runner train ... 2>&1 | head` failed the run without a checkpoint once head had its lines
    (a BrokenPipeError from the step line), and SIGHUP (the terminal it ran in, closed) killed
    it outright, its status left `running`."""
    run_dir = tmp_path / "outputs" / "hangup"
    job = [*(arg for arg in LONG_JOB if not arg.startswith("max_steps=")), "max_steps=5000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *job, f"hydra.run.dir={run_dir}"],
        env=hermetic_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while "step 2/5000" not in proc.stdout.readline():
        assert proc.poll() is None
    proc.stdout.close()  # the reader goes, as head does once it has its lines
    deadline = time.monotonic() + 300
    # And the run trains on, writing its step lines from step 3 to a pipe no one reads.
    while max(RunDir(run_dir).losses(), default=0) < 12:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=300) == 128 + signal.SIGHUP
    status = state_of(run_dir)
    assert status["state"] == "cancelled" and "stopped by SIGHUP" in status["error"], status
    assert (run_dir / "checkpoints" / f"step_{status['step']}").is_dir()


def test_a_stop_signal_ignored_at_the_start_stays_ignored() -> None:
    """`nohup runner train` (SIGHUP ignored) took the stop handlers' SIGHUP over, so a closed
    terminal cancelled the run nohup was there to keep; a job a script starts in the
    background (SIGINT ignored) took Ctrl-C."""
    from runner.trainer.parent import stop_signals_to

    def handler(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals_to(handler) as replaced:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is handler
            assert signal.SIGHUP not in replaced and signal.SIGTERM in replaced
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def freeze(run_dir: Path, pid: int, seconds: float) -> None:
    """SIGSTOP `pid`, then date the run's heartbeat and status back by `seconds`, as that long
    frozen leaves them (the frozen process writes neither)."""
    os.kill(pid, signal.SIGSTOP)
    then = time.time() - seconds
    os.utime(run_dir / "heartbeat", (then, then))
    status = state_of(run_dir)
    status["heartbeat_at"] = datetime.fromtimestamp(then, UTC).isoformat(timespec="seconds")
    (run_dir / "status.json").write_text(json.dumps(status))


@pytest.mark.long  # stopped mid-run, then trained on
def test_stop_then_resume_through_the_cli(runner_cli, hermetic_env, tmp_path: Path) -> None:
    # max_steps=40: frozen as its first checkpoint (step 5) appears, the run is still some 35
    # steps from its end. The resume trains what is left, a save every 5 steps: LONG_JOB's 100
    # made it train and save 60 steps more than this needs.
    run_dir = tmp_path / "outputs" / "stopped"
    proc = start_run(hermetic_env, run_dir, "max_steps=40")
    wait_for_checkpoint(run_dir, proc)
    # Suspended (a hang or a paused job looks the same): it holds its lock, but does not beat.
    freeze(run_dir, proc.pid, 150)
    try:
        listing = runner_cli("runs", str(tmp_path / "outputs"))
        (line,) = [ln for ln in listing.stdout.splitlines() if "stopped" in ln]
        assert line.split()[1:3] in (["stalled", "2m"], ["stalled", "3m"]), listing.stdout
        status = api.Run(run_dir).status()
        assert status.state == "stalled" and "no heartbeat for 1" in (status.error or "")
        assert f"stopped (SIGSTOP, Ctrl-Z): process {proc.pid}" in (status.error or "")
        # Stop says what it does: the process handles SIGTERM once continued.
        stop = runner_cli("stop", str(run_dir))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
    assert "the run was stalled (no heartbeat for 1" in stop.stdout, stop.stdout + stop.stderr
    assert f"continued process {proc.pid} so that it saves and stops" in stop.stdout
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert proc.wait(timeout=300) == 143
    status = state_of(run_dir)
    assert status["state"] == "cancelled" and 0 < status["step"] < 40
    assert (run_dir / "checkpoints" / f"step_{status['step']}").is_dir()
    again = runner_cli("stop", str(run_dir))
    assert again.returncode == 2 and "already cancelled" in again.stderr
    resumed = runner_cli("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert state_of(run_dir)["state"] == "completed" and state_of(run_dir)["step"] == 40
    # `runner logs` tells where the first run ended and the resumed one began (train.log had
    # neither line: the console's alone).
    logs = runner_cli("logs", str(run_dir)).stdout
    checkpoint = run_dir / "checkpoints" / f"step_{status['step']}"
    assert f"stopped by SIGTERM at step {status['step']}: checkpoint {checkpoint}" in logs, logs
    assert f"resuming from {checkpoint} at step {status['step']}" in logs, logs
    again = runner_cli("resume", str(run_dir))
    assert (
        again.returncode == 2
        and (
            "the run is already completed; to train on from its last checkpoint, start a new run "
            f"from it: runner train load_checkpoint.path={run_dir} max_steps=<more>"
        )
        in again.stderr
    )
    listing = runner_cli("runs", str(tmp_path / "outputs"))
    assert "completed" in listing.stdout and "40/40" in listing.stdout


def test_lifecycle_commands_refuse_what_is_not_a_run(runner_cli, tmp_path: Path) -> None:
    for command in ("logs", "stop", "resume"):
        result = runner_cli(command, str(tmp_path))
        assert result.returncode == 2 and "not a run directory" in result.stderr
    assert runner_cli("runs", str(tmp_path)).stdout.startswith("no runs under")
    # Each says what is there: nothing, or a file.
    missing = runner_cli("logs", str(tmp_path / "nothing"))
    assert missing.stderr.startswith(f"error: RUN='{tmp_path / 'nothing'}': no such directory")
    (tmp_path / "train.log").write_text("")
    a_file = runner_cli("runs", str(tmp_path / "train.log"))
    assert a_file.returncode == 2 and "train.log': a file; give a directory" in a_file.stderr


def test_lifecycle_commands_given_a_sweep_name_its_jobs(runner_cli, tmp_path: Path) -> None:
    """`runner resume SWEEP` said "not a run directory" and sent the user to `runner runs`."""
    from runner.rundir import RunDir

    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        (sweep / job).mkdir(parents=True)
        RunDir(sweep / job).write_status("failed", step=2, total_steps=4)
    (sweep / "multirun.yaml").write_text("{}")  # as Hydra's sweeper writes it
    for command in ("logs", "stop", "resume"):
        result = runner_cli(command, str(sweep))
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr == (
            f"error: RUN='{sweep}': a sweep directory, not a run: give one of its jobs "
            f"({sweep / '0'}, ...; `runner runs {sweep}` lists them)\n"
        )


def test_a_run_whose_status_cannot_be_read_is_named_so_by_stop_resume_and_logs(
    runner_cli, tmp_path: Path
) -> None:
    """A status.json cut short (a full disk, a copy stopped midway) has no state: stop and
    resume each say so and the way on, rather than send the user from one to the other."""
    run = tmp_path / "cut"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    (run / "checkpoints" / "step_4" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, run / "checkpoints" / "step_4" / "model.safetensors")
    (run / "status.json").write_text('{"state": "cancelled", "step": 4, "ho')
    (run / "train.log").write_text("step 4 of 10\n")
    fix = f"start a new run from its last checkpoint: runner train load_checkpoint.path={run}"
    for command in ("stop", "resume"):
        result = runner_cli(command, str(run))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith(f"error: RUN='{run}': its status.json cannot be read")
        assert fix in result.stderr and "host None" not in result.stderr
    # Its log is shown all the same, and -f does not follow a run that no process trains.
    assert runner_cli("logs", "-f", str(run)).stdout == "step 4 of 10\n"
    (run / "train.log").unlink()
    result = runner_cli("logs", str(run))
    assert result.returncode == 2 and "wrote no train.log" in result.stderr, result.stderr
    # Deploy served its latest checkpoint (select.checkpoint=best: "recorded no best checkpoint
    # (unknown at step None)"), where one whose status.json is missing is named: so is this.
    for select in ([], ["select.checkpoint=best"]):
        result = runner_cli("deploy", f"checkpoint={run}", "port=0", *select)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert (
            f"error: checkpoint='{run}': a run dir whose status.json cannot be read (cut short, "
            "or not runner's), so it has no recorded state or best to pick by; name one of its "
            f"checkpoints, e.g. its latest: checkpoint={run / 'checkpoints' / 'step_4'}"
        ) in result.stderr


def test_a_running_sweeps_directory_is_not_read_as_a_run_starting(runner_cli, tmp_path) -> None:
    """The sweep's own process holds a lock on its directory while it runs (api.Sweep.wait
    reads it); held as a run's lock, `runner logs SWEEP` and `runner stop SWEEP` waited for a
    run to start there until the sweep ended."""
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    with sweep_lock_held(sweep):
        for command in ("logs", "stop"):
            result = runner_cli(command, str(sweep))
            assert result.returncode == 2, result.stderr
            assert "not a run directory" in result.stderr and "starting" not in result.stderr


def test_a_run_whose_status_is_missing_names_the_way_on(runner_cli, tmp_path: Path) -> None:
    """A run's directory without its status.json (a partial copy, a clean-up): resume, stop and
    deploy each said "not a run directory" and sent the user to `runner runs`, which lists no
    run there; they name its last checkpoint, as for a status.json that cannot be read, and
    `runner logs` prints its train.log where it wrote one."""
    run = tmp_path / "copied"
    for step in (2, 4):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "config.json").write_text("{}")
        save_file({"w": torch.zeros(1)}, run / "checkpoints" / f"step_{step}" / "model.safetensors")
    (run / "recipe.yaml").write_text("version: 1\n")
    latest = run / "checkpoints" / "step_4"
    for command in ("stop", "resume"):
        result = runner_cli(command, str(run))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr == (
            f"error: RUN='{run}': its status.json is missing, so its state is unknown; start a "
            f"new run from its last checkpoint: runner train load_checkpoint.path={latest}\n"
        )
    result = runner_cli("logs", str(run))
    assert result.returncode == 2 and "status.json is missing" in result.stderr, result.stderr
    listed = runner_cli("runs", str(run))
    assert listed.stdout == f"no runs under {run}\n", listed.stdout
    assert f"{run}: a run's directory whose status.json is missing; `runner logs {run}`" in (
        listed.stderr
    )
    # Its log is shown all the same, and -f does not follow a run that no process trains.
    (run / "train.log").write_text("step 4 of 10\n")
    shown = runner_cli("logs", "-f", str(run))
    # At once: it waited its 30 s for a run to start there, as at a path that holds none.
    assert shown.stdout == "step 4 of 10\n" and shown.stderr == "", shown.stderr
    result = runner_cli("deploy", f"checkpoint={run}", "port=0")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (
        f"error: checkpoint='{run}': a run dir whose status.json is missing, so it has no "
        "recorded state or best to pick by; name one of its checkpoints, e.g. its latest: "
        f"checkpoint={latest}"
    ) in result.stderr


def test_a_run_inside_another_runs_directory_is_refused(runner_cli, tmp_path: Path) -> None:
    """hydra.run.dir=RUN/sub, or runtime.output_root inside a run: the new run trained where
    `runner runs` never listed it (it looks for no run inside another)."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_status("completed", step=4, total_steps=4)
    inside = run.path / "sub"
    for given, key in (
        (f"hydra.run.dir={inside}", "hydra.run.dir"),
        (f"runtime.output_root={inside}", "runtime.output_root"),
    ):
        result = runner_cli("train", *QUICK, "max_steps=1", given)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert (
            f"error: {key}='{inside}': is inside the run directory {run.path}, where `runner "
            "runs` does not look for runs; give a directory outside it\n"
        ) in result.stderr
    assert sorted(p.name for p in run.path.iterdir()) == ["status.json"]


def test_a_state_no_runner_writes_signals_no_process(runner_cli, tmp_path: Path) -> None:
    """A state another version or a hand wrote (`paused`) read as a live run: `runner stop`
    signalled whatever process then had the pid it names (here, someone's sleep)."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        run = RunDir(tmp_path / "paused")
        run.path.mkdir()
        run.write_status("running", step=2, launcher_pid=sleeper.pid)
        status = json.loads((run.path / "status.json").read_text())
        (run.path / "status.json").write_text(json.dumps({**status, "state": "paused"}))
        result = runner_cli("stop", str(run.path))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: RUN='{run.path}': its status.json cannot be read")
        assert sleeper.poll() is None
    finally:
        sleeper.kill()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs commands as another user: needs root and setpriv",
)
def test_another_users_run_is_one_line_of_permission(hermetic_env) -> None:
    """`runner stop` of another user's run and `runner logs` of one this user may not read were
    tracebacks (PermissionError); `runner runs` left an unreadable run out without a word."""
    root = Path(tempfile.mkdtemp(prefix="runner-perm-"))  # pytest's tmp_path is root's alone
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        root.chmod(0o755)
        run = RunDir(root / "theirs")
        with run_lock(run.path, key="RUN"):
            run.write_status("running", step=2, launcher_pid=sleeper.pid)
            (run.path / "status.json").chmod(0o644)
            (run.path / "train.log").write_text("step 2\n")

            def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
                nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
                return subprocess.run(
                    [*nobody, sys.executable, "-m", "runner", *args],
                    cwd=root,
                    env=hermetic_env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )

            stop = as_nobody("stop", str(run.path))
            assert stop.returncode == 2 and "Traceback" not in stop.stderr, stop.stderr
            assert "is another user's; only that user (or root) can stop it" in stop.stderr
            assert sleeper.poll() is None
            run.path.chmod(0o700)
            logs = as_nobody("logs", str(run.path))
            assert logs.returncode == 2 and "Traceback" not in logs.stderr, logs.stderr
            assert "permission denied" in logs.stderr
            runs = as_nobody("runs", str(root))
            assert f"not read (permission denied): {run.path}" in runs.stderr, runs.stderr
        # A data file of another user's: Hydra's report, a generic line, the run's directory
        # left behind.
        data = root / "data.jsonl"
        data.write_text((SAMPLE_DATA_DIR / "train.jsonl").read_text())
        data.chmod(0o600)
        (root / "theirs_too").mkdir()
        (root / "theirs_too").chmod(0o777)
        new = root / "theirs_too" / "new"
        train = as_nobody("train", *QUICK, f"dataset.source={data}", f"hydra.run.dir={new}")
        assert train.returncode == 2 and not new.exists(), train.stderr[-3000:]
        assert train.stderr.endswith(
            f"error: dataset.source='{data}': this user (uid 65534) may not read it\n"
        ), train.stderr[-3000:]
    finally:
        sleeper.kill()
        shutil.rmtree(root)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_before_its_status_leaves_no_directory(hermetic_env, tmp_path, signum, code):
    """Ctrl-C or SIGTERM in the seconds before a run records its status (importing torch,
    resolving the recipe): the directory held .hydra/, .lock and train.log, which no command
    lists, resumes or cleans; SIGTERM killed the process outright."""
    run_dir = tmp_path / "outputs" / "starting"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *QUICK, f"hydra.run.dir={run_dir}"],
        env=hermetic_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / ".hydra").exists():  # Hydra's, once the run took its directory
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.005)
    proc.send_signal(signum)
    assert proc.wait(timeout=300) == code, proc.stderr.read()[-3000:]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_a_stop_before_the_workers_passes_code_that_catches_every_exception() -> None:
    """The stop a launcher takes before its workers start is raised wherever its code stands:
    as an Exception, OmegaConf remade it from its message alone (a TypeError: the test below
    failed 1 run in 20 with a traceback, the run left `created`); a logging handler's emit
    swallowed it (test_a_stop_swallowed_before_the_workers_is_sent_again)."""
    from omegaconf import OmegaConf
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from runner.job.stops import StopBeforeWorkers

    def stop(exc: BaseException) -> None:
        raise exc

    OmegaConf.register_new_resolver("test_stop", lambda: stop(raised), replace=True)
    cfg = OmegaConf.create({"compute": {"platform": "${test_stop:}"}})
    raised: BaseException = SignalException("got signal", sigval=signal.SIGTERM)
    with pytest.raises(Exception) as remade:  # noqa: PT011 - whatever OmegaConf made of it
        _ = cfg.compute.platform
    assert not isinstance(remade.value, SignalException)
    raised = StopBeforeWorkers(signal.SIGTERM)
    with pytest.raises(StopBeforeWorkers) as passed:
        _ = cfg.compute.platform
    assert passed.value.sigval == signal.SIGTERM


# Two processes' stop in `pytest -m long` (a run of workers signalled as it starts).
@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.long)])
def test_a_stop_as_the_run_starts_ends_it_cancelled(hermetic_env, tmp_path, processes) -> None:
    """Signalled as soon as its status names its process, before the loop's own handlers (or
    the elastic agent's): a one-process run saves after its first step, a run of workers ends
    before they start; cancelled either way, where the signal killed it, left `created`."""
    run_dir = tmp_path / "starting"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *LONG_JOB, f"hydra.run.dir={run_dir}"]
        + [f"compute.nproc_per_node={processes}"],
        env=hermetic_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / "status.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.005)
    assert state_of(run_dir)["state"] == "created"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, proc.stderr.read()[-3000:]
    status = state_of(run_dir)
    if processes == 1:
        assert status["state"] == "cancelled" and status["step"] == 1, status
        assert (run_dir / "checkpoints" / "step_1").is_dir()
    else:
        assert status["state"] == "cancelled" and status["step"] == 0, status
        assert status["error"] == "stopped by SIGTERM before its first step", status
        # No worker said it (it said nothing at all): the launcher does.
        stopped = f"stopped by SIGTERM; status in {run_dir}/status.json"
        assert stopped in proc.stderr.read()


def swallowing_logger() -> logging.Logger:
    """A logger whose output is stopped midway by a SIGTERM: what the launcher's handler raises
    there, which a logging handler's emit catches, prints and goes on from where it is an
    Exception (torch's SignalException, inside elastic_launch)."""

    class StoppedMidWrite(io.StringIO):
        def write(self, text: str) -> int:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler raises here
            return super().write(text)

    logger = logging.getLogger("tests.swallowed")
    logger.propagate = False
    logger.handlers = [logging.StreamHandler(StoppedMidWrite())]
    return logger


def created_run(path: Path) -> RunDir:
    run = RunDir(path)
    run.path.mkdir()
    run.write_status("created", step=0, total_steps=4, launcher_pid=os.getpid())
    return run


def test_a_stop_swallowed_before_the_workers_is_sent_again(tmp_path, capfd, monkeypatch) -> None:
    """SIGTERM to a launcher of workers raises in whatever its main thread runs. In runner's own
    code that is StopBeforeWorkers, which no `except Exception` swallows: the launcher ends at
    once. In torch's start-up it is torch's SignalException, which code that catches every
    Exception swallowed (a logging handler's emit, as here): the stop was lost, and the run
    trained to its end. The launcher sends it again."""
    monkeypatch.setattr(stops, "RESEND_S", 0.3)
    run = created_run(tmp_path / "run")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, stops.stops_before_workers(run):
        swallowing_logger().warning("workers: forked")
        pytest.fail("the stop was swallowed")
    assert stopped.value.code == 143 and "--- Logging error ---" not in capfd.readouterr().err
    assert run.status().state == "cancelled"
    run, started = created_run(tmp_path / "in_torch"), time.monotonic()
    with pytest.raises(SystemExit) as stopped, stops.stops_before_workers(run):
        stops.agent_holds_stops()  # as _elastic_launch does before elastic_launch
        swallowing_logger().warning("launch: 1 node(s) x 2 process(es)")
        time.sleep(60)  # the workers' start and training, which the signal sent again ends
    assert stopped.value.code == 143
    assert time.monotonic() - started < 30
    assert "--- Logging error ---" in capfd.readouterr().err  # where the first one went
    status = run.status()
    assert status.state == "cancelled", status
    assert status.error == "stopped by SIGTERM before its first step", status
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_stop_sent_again_reaches_the_agents_handler_once(tmp_path, monkeypatch) -> None:
    """A stop swallowed as the elastic agent took the signals: the agent's handler gets it once,
    then waits for its workers to save; sent each second, it cut that wait short."""
    monkeypatch.setattr(stops, "RESEND_S", 0.3)
    run = created_run(tmp_path / "run")
    agents: list[int] = []
    with stops.stops_before_workers(run):
        stops.agent_holds_stops()  # as _elastic_launch does before elastic_launch
        swallowing_logger().warning("launch: 1 node(s) x 2 process(es)")
        signal.signal(signal.SIGTERM, lambda signum, frame: agents.append(signum))
        time.sleep(2)  # the agent's wait for its workers (PContext's handlers set as it starts)
    assert agents == [signal.SIGTERM]


def test_logs_of_a_starting_run_waits_for_it_then_follows(runner_cli, hermetic_env, tmp_path):
    """A run holds its lock before Hydra writes into its directory and records its status
    seconds later, once its recipe is resolved and its data checked: `runner logs -f` typed in
    between waits for it, rather than deny that it is a run, then follows it to its end."""
    run_dir = tmp_path / "starting"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *QUICK, "max_steps=4"]
        + ["runtime.log_every_n_steps=1", f"hydra.run.dir={run_dir}"],
        env=hermetic_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    # Held, not only made: stopped between making the file and taking its flock, the run read
    # as none to `runner logs`, which waited 30 s for one while it stayed stopped.
    while not ((run_dir / ".lock").exists() and lock_held(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGSTOP)  # within the seconds of its start-up
    try:
        assert not (run_dir / "status.json").exists()
        out, err = tmp_path / "logs.out", tmp_path / "logs.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            logs = subprocess.Popen(
                [sys.executable, "-m", "runner", "logs", str(run_dir), "-f"],
                env=hermetic_env,
                stdout=stdout,
                stderr=stderr,
            )
        while "the run is starting; waiting for its status.json" not in err.read_text():
            assert logs.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=300) == 0
    assert logs.wait(timeout=60) == 0, err.read_text()
    followed = out.read_text()
    assert "step 1/4 loss" in followed and "eval at step 4: eval_loss" in followed


def test_logs_follow_waits_for_a_run_to_start_where_none_is_yet(hermetic_env, tmp_path) -> None:
    """`runner logs -f RUN` typed just after `runner train hydra.run.dir=RUN &` came before the
    directory did, and was refused as no such directory: it waits for a run to start there."""
    run = tmp_path / "soon"
    err = tmp_path / "logs.err"
    with open(err, "w") as stderr:
        logs = subprocess.Popen(
            [sys.executable, "-m", "runner", "logs", "-f", str(run)],
            env=hermetic_env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    # The command is up and waiting, and says so (it would have been refused by now).
    deadline = time.monotonic() + 300
    waiting = f"{run}: no run there yet; waiting up to 30 s for one to start"
    while waiting not in err.read_text():
        assert logs.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)
    run.mkdir()
    (run / "train.log").write_text("step 4 of 4\n")
    (run / "status.json").write_text(json.dumps({"state": "completed", "step": 4}))
    out, _ = logs.communicate(timeout=60)
    assert logs.returncode == 0 and out == "step 4 of 4\n", err.read_text()


TWO_PROCESSES = [
    "compute=cpu",
    "dtype=fp32",
    "compute.nproc_per_node=2",
    "max_steps=400",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=null",
    "dataset.eval_samples=0",
]


def start_two_processes(env: dict[str, str], run_dir: Path) -> tuple[subprocess.Popen, list[int]]:
    """A 2-process CPU run under the elastic agent, once it has logged 2 steps; its workers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "train", *TWO_PROCESSES, f"hydra.run.dir={run_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a shell's foreground job
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, [int(pid) for pid in children]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (its parent, the test, has not reaped it yet) is gone too.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
    }


@pytest.mark.long  # two processes stopped mid-run
def test_a_run_is_kept_from_a_second_trainer_until_its_last_process_is_gone(
    runner_cli, hermetic_env, tmp_path: Path
) -> None:
    run_dir = tmp_path / "outputs" / "two"
    proc, workers = start_two_processes(hermetic_env, run_dir)
    assert len(workers) == 2
    hydra_files = {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    # Frozen, the run writes nothing itself: whatever changes is the second trainer's doing.
    for pid in (proc.pid, *workers):
        os.kill(pid, signal.SIGSTOP)
    before = snapshot(run_dir)
    try:
        second = runner_cli("train", f"resume={run_dir}")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"resume='{run_dir}'" in second.stderr
        assert f"trained by process {proc.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert snapshot(run_dir) == before
        # A new run pointed at it is refused before Hydra writes its .hydra/ or log there.
        into = runner_cli("train", *TWO_PROCESSES, "seed=7", f"hydra.run.dir={run_dir}")
        assert {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
        assert snapshot(run_dir) == before
        assert into.returncode == 2, into.stderr[-3000:]
        assert f"hydra.run.dir='{run_dir}'" in into.stderr
        assert f"trained by process {proc.pid}" in into.stderr
        assert "give another hydra.run.dir" in into.stderr
        # The launcher dies (kill -9); its workers, frozen still, hold the run's lock on.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # not its output: the workers hold the pipe open
        listing = runner_cli("runs", str(tmp_path / "outputs"))
        (line,) = [ln for ln in listing.stdout.splitlines() if "two" in ln]
        assert line.split()[1] == "stopping", listing.stdout
        # A resume typed now waits for them, saying so, and touches nothing meanwhile.
        third_out = tmp_path / "third.out"
        third = start_resume(hermetic_env, run_dir, third_out)
        deadline = time.monotonic() + 120
        while "waiting up to 300 s for the run to end" not in third_out.read_text():
            assert third.poll() is None and time.monotonic() < deadline, third_out.read_text()
            time.sleep(0.1)
        assert f"its launcher, process {proc.pid}, is gone" in third_out.read_text()
        with open(run_dir / ".lock") as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert snapshot(run_dir) == before and third.poll() is None
    finally:
        for pid in (proc.pid, *workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    try:
        check_orphans_then_resume(run_dir, proc, workers, third, third_out)
    finally:
        if third.poll() is None:
            third.send_signal(signal.SIGTERM)
            third.wait(timeout=300)


def check_orphans_then_resume(
    run_dir: Path, proc: subprocess.Popen, workers: list[int], third, third_out: Path
) -> None:
    """The orphaned workers save and end the run, then the waiting resume goes on from their
    checkpoint, as its own run of the directory, and is stopped by SIGTERM."""
    # Told by the parent-death signal, the workers stop as on SIGTERM: they save and record the
    # run cancelled. Until they exit it reads `stopping`, never `failed`; then what they recorded
    # (until the waiting resume, once they are gone, takes the run: its states are not theirs).
    seen, deadline = [], time.monotonic() + 120
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        state = RunDir(run_dir).effective_state()[0]
        if RunDir(run_dir).status().launcher_pid != proc.pid:
            break
        seen.append(state)
        time.sleep(0.01)
    assert not any(alive(pid) for pid in workers), "workers outlived their launcher"
    output = proc.communicate()[0]
    assert set(seen) <= {"stopping", "cancelled"} and seen[0] == "stopping", seen
    saved = re.search(r"SIGTERM at step (\d+): checkpoint (\S+);", output)
    assert saved and Path(saved.group(2)).is_dir(), output[-3000:]
    resumed_from = int(saved.group(1))
    deadline = time.monotonic() + 300
    while not (
        state_of(run_dir).get("launcher_pid") == third.pid
        and state_of(run_dir)["state"] == "running"
        and (state_of(run_dir).get("step") or 0) > resumed_from
    ):
        assert third.poll() is None and time.monotonic() < deadline, third_out.read_text()
        time.sleep(0.1)
    third.send_signal(signal.SIGTERM)
    assert third.wait(timeout=300) == 143, third_out.read_text()[-3000:]
    status = state_of(run_dir)
    assert status["state"] == "cancelled" and "SIGTERM" in status["error"], status
    assert status["step"] > resumed_from
    assert RunDir(run_dir).effective_state() == ("cancelled", None)
    assert (run_dir / "checkpoints" / f"step_{status['step']}").is_dir()
    with open(run_dir / ".lock") as lock:  # and the lock went with the last of them
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def start_resume(env: dict[str, str], run_dir: Path, output: Path) -> subprocess.Popen:
    """`runner train resume=RUN_DIR` in the background, its output into `output`."""
    with open(output, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "runner", "train", f"resume={run_dir}"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


# A launcher and the workers it starts, holding a run's lock as runner train's do, without the
# training: the launcher takes it, starts the WORKER script given twice and prints their pids;
# each worker joins the lock when told (a go_* file).
LAUNCHER = """
import os, subprocess, sys, time
from pathlib import Path
from runner.rundir import run_lock
with run_lock(Path(sys.argv[1]), key="hydra.run.dir"):
    workers = [
        subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], name, str(os.getpid())])
        for name in (("early", "late") if sys.argv[2:] else ())
    ]
    print(*[w.pid for w in workers], flush=True)
    time.sleep(600)
"""
WORKER = """
import sys, time
from pathlib import Path
from runner.rundir import join_run_lock
run_dir, name, launcher = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
while not (run_dir / f"go_{name}").exists():
    time.sleep(0.01)
(run_dir / f"tmp_{name}").write_text(str(join_run_lock(launcher)))
(run_dir / f"tmp_{name}").rename(run_dir / f"joined_{name}")
time.sleep(600)
"""


def start_launcher(run_dir: Path, *worker: str) -> tuple[subprocess.Popen, list[int]]:
    """A LAUNCHER holding `run_dir`'s lock, with its WORKERs if given; their pids."""
    command = [sys.executable, "-c", LAUNCHER, str(run_dir), *worker]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    return launcher, [int(pid) for pid in launcher.stdout.readline().split()]


def joined(run_dir: Path, name: str) -> bool:
    """Whether a WORKER, told to join now, holds the lock."""
    (run_dir / f"go_{name}").touch()
    deadline = time.monotonic() + 60
    while not (run_dir / f"joined_{name}").exists():
        assert time.monotonic() < deadline, f"worker {name} never tried to join"
        time.sleep(0.01)
    return (run_dir / f"joined_{name}").read_text() == "True"


def test_workers_hold_the_run_lock_after_their_launcher_dies(tmp_path: Path) -> None:
    run_dir, run = tmp_path / "run", RunDir(tmp_path / "run")
    launcher, workers = start_launcher(run_dir, WORKER)
    try:
        run.write_status("running", step=3, launcher_pid=launcher.pid)
        assert joined(run_dir, "early")
        launcher.kill()
        launcher.wait()
        # Its worker holds the lock on: the run reads `stopping`, and no trainer can take it.
        assert run.effective_state()[0] == "stopping"
        with pytest.raises(RunLocked, match=f"the workers of process {launcher.pid}"):
            with run_lock(run_dir, key="resume"):
                pass
        # A worker that would join after its launcher died leaves the run alone.
        assert not joined(run_dir, "late")
        assert run.effective_state()[0] == "stopping"
    finally:
        for pid in (launcher.pid, *workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while run.effective_state()[0] == "stopping" and time.monotonic() < deadline:
        time.sleep(0.05)  # until the kernel has closed the killed worker's files
    # With no process of it left and nothing recorded, it failed; a trainer may take it now.
    gone = f"process {launcher.pid} is gone and the status was never updated"
    assert run.effective_state() == ("failed", gone)
    with run_lock(run_dir, key="resume"):
        pass


def test_a_new_run_into_a_locked_run_dir_leaves_its_record_alone(runner_cli, tmp_path) -> None:
    run_dir = tmp_path / "held"
    (run_dir / ".hydra").mkdir(parents=True)
    record = {name: f"the holder's {name}\n".encode() for name in ("config.yaml", "overrides.yaml")}
    for name, text in record.items():
        (run_dir / ".hydra" / name).write_bytes(text)
    holder, _ = start_launcher(run_dir)
    try:
        into = runner_cli("train", *QUICK, "max_steps=1", f"hydra.run.dir={run_dir}")
    finally:
        holder.kill()
        holder.wait()
    # Hydra wrote nothing there: the lock was taken before it writes .hydra/ and train.log.
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record
    assert not (run_dir / "train.log").exists()
    assert into.returncode == 2, into.stderr[-3000:]
    assert f"hydra.run.dir='{run_dir}': the run is being trained by process {holder.pid}" in (
        into.stderr
    )
    assert "give another hydra.run.dir" in into.stderr and "Traceback" not in into.stderr


@pytest.mark.long  # signalled mid-run
def test_ctrl_c_of_a_two_process_run_saves_and_exits_130(hermetic_env, tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"
    proc, _ = start_two_processes(hermetic_env, run_dir)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    status = state_of(run_dir)
    assert status["state"] == "cancelled" and "SIGINT" in status["error"], status
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{status['step']}"]
    assert f"`runner resume {run_dir}` continues" in output
    # Said once, by the worker that saved it: the launcher said "stopped by SIGINT" again.
    stopped = [line for line in output.splitlines() if line.startswith("stopped by SIGINT")]
    assert len(stopped) == 1, output[-3000:]
    # The saved workers end as they return: the agent, shutting down, never took their results
    # and killed them 30 s on, the run held all that while.
    assert "Unable to shutdown process" not in output, output[-3000:]
