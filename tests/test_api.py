"""runner.api end to end: real detached `runner train | deploy` processes on the tiny model, CPU."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runner import api
from runner.errors import UserError
from runner.paths import CONF_DIR, SAMPLE_DATA_DIR
from runner.rundir import Status
from tests.conftest import ESTIMATE_DATA, load_script

# One process on the CPU, a loss line every step, no evaluation: the runs are short.
BASE = [
    "compute=cpu",
    "dtype=fp32",
    "runtime.progress_bar=false",
    "runtime.loggers=[]",
    "runtime.log_every_n_steps=1",
    "runtime.save_every_n_steps=null",
    "eval.strategy=no",
    "dataset.eval_samples=0",
]
STEPS = 30


def wait_for_step(run: api.Run, step: int, timeout: float = 300) -> None:
    """Until `run` has logged `step` (it must still be running then)."""
    deadline = time.monotonic() + timeout
    while max(run.dir.losses(), default=0) < step:
        assert not run.done() and time.monotonic() < deadline, (run.status(), run.console())
        time.sleep(0.05)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("api")


@pytest.fixture(scope="module")
def straight(workdir: Path, hermetic_env: dict[str, str]) -> tuple[api.Run, list[str]]:
    """A whole run through the API, its log followed while it trains."""
    run = api.launch([*BASE, f"max_steps={STEPS}"], cwd=workdir, env=hermetic_env)
    assert run.status().state in ("created", "initializing", "running")
    followed = list(run.logs(follow=True, interval=0.2))
    run.wait(timeout=600)
    return run, followed


def test_a_run_launched_through_the_api_trains_to_completion(straight, workdir: Path) -> None:
    run, followed = straight
    status = run.status()
    assert status.state == "completed" and status.step == STEPS, status
    assert run.path.parent.parent == workdir / "outputs"  # runtime.output_root/<date>/<time>-id
    losses = run.dir.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] == status.loss
    assert losses[STEPS] < losses[1]  # it learns
    assert [r["step"] for r in run.metrics()] == list(range(1, STEPS + 1))
    # Following the log while it trained saw what the log holds at the end, line for line.
    assert followed == list(run.logs()) and f"step {STEPS}/{STEPS}" in followed[-1]

    async def collect() -> list[str]:
        return [line async for line in run.logs(follow=True)]

    assert asyncio.run(collect()) == followed
    assert f"status:        completed at step {STEPS}" in run.console()
    assert api.Run(run.path).status() == status  # a handle on the directory reads the same
    # Listed as `runner runs` lists it.
    (listed,) = [found for found in api.runs(workdir / "outputs") if found.path == run.path]
    assert listed.status() == status
    with pytest.raises(UserError, match="no such directory; give a directory that holds runs"):
        api.runs(workdir / "nowhere")


@pytest.mark.long
def test_stop_and_resume_through_the_api_give_the_straight_run_losses(
    straight, workdir: Path, hermetic_env: dict[str, str]
) -> None:
    run = api.launch([*BASE, f"max_steps={STEPS}"], cwd=workdir, env=hermetic_env)
    wait_for_step(run, 3)
    stopped = run.stop()  # SIGTERM: a checkpoint at the step it stopped at
    assert stopped.state == "cancelled" and "SIGTERM" in stopped.error, stopped
    assert [step for step, _ in run.dir.checkpoints()] == [stopped.step] and stopped.step < STEPS
    with pytest.raises(UserError, match="already cancelled"):
        run.stop()
    run.resume()
    # Resuming, not the attempt before's end, from the first read on: a poller for a final
    # state stopped at once, and once the new launcher rewrote the old state with its own time,
    # status.json itself read `cancelled` for seconds (a `runner stop` then was refused).
    seen = set()
    while (state := run.status().state) != "running":
        assert not run.done(), run.console()[-3000:]
        recorded = run.dir.status()  # once the new launcher has recorded itself
        mine = recorded.launcher_pid not in (None, stopped.launcher_pid)
        seen.add((state, recorded.state if mine else "-"))
        time.sleep(0.1)
    assert all("cancelled" not in pair for pair in seen), seen
    # A second resume (a retry) started a process the lock refused, and wait() followed that.
    with pytest.raises(UserError, match="a resume under way"):
        run.resume()
    wait_for_step(run, stopped.step + 3)
    killed = run.stop(save_checkpoint=False)  # SIGKILL: the steps since step_<stopped> are lost
    assert killed.state == "cancelled" and "killed without a checkpoint" in killed.error, killed
    assert [step for step, _ in run.dir.checkpoints()] == [stopped.step]
    with pytest.raises(UserError, match="latest whole checkpoint"):
        run.resume(checkpoint=workdir)
    final = run.resume(checkpoint=run.dir.checkpoint_path(stopped.step)).wait(timeout=600)
    assert final.state == "completed" and final.step == STEPS, (final, run.console()[-3000:])
    # The same process count and kernels on the same machine: bit-identical losses.
    assert run.dir.losses() == straight[0].dir.losses()


def test_a_stop_right_after_the_launch_stops_the_run(
    workdir: Path, hermetic_env: dict[str, str]
) -> None:
    """Before the run recorded its process, stop() was refused ("the run is on host None"),
    and the run trained to its end."""
    run = api.launch([*BASE, "max_steps=400"], cwd=workdir, env=hermetic_env)
    stopped = run.stop(timeout=300)
    assert stopped.state == "cancelled" and "SIGTERM" in stopped.error, stopped
    assert stopped.step < 400


def stop_within(run: api.Run, seconds: float, **options: Any) -> Status:
    """run.stop(**options), which must return within `seconds` (it hung on a zombie)."""
    stopped: list[Status] = []
    thread = threading.Thread(target=lambda: stopped.append(run.stop(**options)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert stopped, f"stop() still waits after {seconds} s; status {run.dir.status()}"
    return stopped[0]


@pytest.mark.long  # a run and a sweep's job killed
def test_a_kill_through_a_second_handle_ends_a_run_and_its_sweep_launched_here(
    workdir: Path, hermetic_env: dict[str, str]
) -> None:
    """A handle from api.Run(path), api.runs() or Sweep.runs() on a run this process launched:
    the killed launcher, a zombie until this process reaped it, was waited for for ever, and
    the run stayed `running`; a sweep's job killed so left its summary as it was."""
    run = api.launch([*BASE, "max_steps=400"], cwd=workdir, env=hermetic_env)
    try:
        wait_for_step(run, 2)
        killed = stop_within(api.Run(run.path), 30, save_checkpoint=False)
        assert killed.state == "cancelled" and "killed without a checkpoint" in killed.error
        assert run.wait(timeout=60).state == "cancelled"
    finally:
        run.wait(timeout=60)  # reaps the launcher: a hung stop() then ends
    sweep = api.sweep(
        [*BASE, "runtime.save_every_n_steps=1", "max_steps=2,400"],
        cwd=workdir,
        env=hermetic_env,
    )
    try:
        while len(sweep.runs()) < 2:
            assert sweep._process is not None and sweep._process.poll() is None, sweep.path
            time.sleep(0.1)
        wait_for_step(sweep.runs()[1], 2)
        killed = stop_within(sweep.runs()[1], 30, save_checkpoint=False)
        assert killed.state == "cancelled" and "resume continues from" in killed.error, killed
    finally:
        summary = sweep.wait(timeout=60)  # the kill ended the sweep's process too
    assert summary is not None, sweep.path
    states = [(row["job"], row["state"]) for row in summary["runs"]]
    assert states == [("0", "completed"), ("1", "cancelled")], summary


@dataclass
class WaitedSweep:
    sweep: api.Sweep  # api.sweep's handle
    other: api.Sweep  # api.Sweep(path): a handle with no process of its own
    early: TimeoutError  # other.wait(timeout=0.5), while the sweep trained
    summary: dict[str, Any] | None  # other.wait() to the end
    ended: bool  # whether the sweep's process had ended when that returned


@pytest.fixture(scope="module")
def seed_sweep(workdir: Path, hermetic_env: dict[str, str]) -> WaitedSweep:
    """A sweep of two jobs through the API, waited for through a second handle on its directory
    while it trains; its best run is deployed below."""
    sweep = api.sweep([*BASE, "max_steps=2", "seed=0,1"], cwd=workdir, env=hermetic_env)
    assert sweep._process is not None
    while not (sweep.path / "multirun.yaml").is_file():  # until it is a sweep directory
        assert sweep._process.poll() is None, sweep.path
        time.sleep(0.1)
    other = api.Sweep(sweep.path)
    with pytest.raises(TimeoutError) as early:
        other.wait(timeout=0.5)
    summary = other.wait(timeout=600)
    return WaitedSweep(sweep, other, early.value, summary, sweep._process.poll() is not None)


def test_a_handle_on_a_sweep_by_its_directory_waits_for_the_sweep_to_end(
    seed_sweep: WaitedSweep,
) -> None:
    """api.Sweep(path), a handle with no process of its own (another caller's, a service's
    restart), returned from wait() at once, with no summary, while the sweep trained on."""
    sweep, other, summary = seed_sweep.sweep, seed_sweep.other, seed_sweep.summary
    assert "is still running" in str(seed_sweep.early)
    assert seed_sweep.ended, "wait() returned while the sweep ran"
    assert summary is not None and [r["state"] for r in summary["runs"]] == ["completed"] * 2
    assert summary == sweep.summary() and (sweep.path / "loss_curves.png").is_file()
    # What its process printed, the summary table, through either handle.
    assert f"sweep directory: {sweep.path}" in sweep.console() == other.console()


def test_a_sweep_goes_to_the_sweep_directory_its_overrides_name(
    workdir: Path, hermetic_env: dict[str, str]
) -> None:
    """hydra.sweep.dir, as `runner train -m` takes it (relative to cwd=): api.sweep put the sweep
    under runtime.multirun_root all the same; and given again with other values, it is refused
    as the CLI refuses it. Its data by a path relative to cwd= too, checked from there."""
    lines = (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines(keepends=True)
    (workdir / "first_40.jsonl").write_text("".join(lines[:40]))
    data = ["dataset=instruct", "dataset.source=first_40.jsonl"]
    given = [*BASE, *data, "max_steps=2", "seed=0,1", "hydra.sweep.dir=sweeps/lr"]
    sweep = api.sweep(given, cwd=workdir, env=hermetic_env)
    assert sweep.path == workdir / "sweeps" / "lr"
    summary = sweep.wait(timeout=600)
    assert summary is not None and [r["state"] for r in summary["runs"]] == ["completed"] * 2
    assert [run.path for run in sweep.runs()] == [workdir / "sweeps/lr/0", workdir / "sweeps/lr/1"]
    other = [*BASE, *data, "max_steps=2", "seed=0,2", "hydra.sweep.dir=sweeps/lr"]
    with pytest.raises(UserError, match=r"^hydra.sweep.dir='.*/sweeps/lr': holds a sweep that"):
        api.sweep(other, cwd=workdir, env=hermetic_env)


def test_a_bad_config_is_a_problem_from_validate_and_a_failed_launch(
    workdir: Path, hermetic_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, runner_cli
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = workdir / "missing.jsonl"
    assert api.validate([*BASE, "max_steps=2"]) == []
    (problem,) = api.validate([*BASE, f"dataset.source={missing}"])
    assert problem.key == "dataset.source" and "no such file" in problem.fix
    (problem,) = api.validate(["model=nope"])
    assert problem.key == "model" and "tiny" in problem.fix
    with pytest.raises(UserError, match="no such option"):
        api.launch(["model=nope"], cwd=workdir, env=hermetic_env)
    with pytest.raises(UserError, match=r"Run\(RUN\).resume\(\)"):
        api.launch([f"resume={workdir}"], cwd=workdir, env=hermetic_env)
    # Launch's own hydra.run.dir came after it and won: the run went elsewhere, unsaid.
    with pytest.raises(UserError, match="hydra.run.dir='/elsewhere': launch makes a new"):
        api.launch(["hydra.run.dir=/elsewhere"], cwd=workdir, env=hermetic_env)
    with pytest.raises(UserError, match="max_steps='abc': give an integer"):
        api.launch([*BASE, "max_steps=abc"], cwd=workdir, env=hermetic_env)
    with pytest.raises(UserError, match="batch_size=0: give an integer >= 1"):
        api.sweep([*BASE, "batch_size=0", "seed=0,1"], cwd=workdir, env=hermetic_env)
    # Refused as `runner train -m` refuses them, before anything is made: a swept value its
    # process refused came back as a handle on an empty sweep directory, and an override that
    # is not one as Hydra's OverrideParseException.
    made = sorted(workdir.rglob("*"))
    with pytest.raises(UserError) as refused:
        api.sweep([*BASE, "optimizer.lr=1e-3,abc"], cwd=workdir, env=hermetic_env)
    printed = runner_cli("train", "-m", *BASE, "optimizer.lr=1e-3,abc", cwd=workdir).stderr
    assert (
        printed == f"error: {refused.value}\n" == "error: optimizer.lr='abc': give a number > 0\n"
    )
    with pytest.raises(UserError, match=r"^override='seed=0,,1': Error parsing override"):
        api.sweep([*BASE, "seed=0,,1"], cwd=workdir, env=hermetic_env)
    with pytest.raises(UserError, match=r"^model='nope': no such option"):
        api.sweep([*BASE, "model=tiny,nope"], cwd=workdir, env=hermetic_env)
    assert sorted(workdir.rglob("*")) == made
    # One string for the list was read a character at a time; a bad env raised Popen's
    # TypeError after the run's directory was made; deploy's message named "this command".
    (problem,) = api.validate("max_steps=4")
    assert str(problem) == "overrides='max_steps=4': give a list of strings, e.g. ['max_steps=4']"
    (problem,) = api.validate(None)  # type: ignore[arg-type]  # an optional body left out
    assert str(problem) == "overrides: give a list of strings, e.g. ['max_steps=4']"
    for call in (api.estimate, api.launch, api.sweep, api.deploy):
        with pytest.raises(UserError, match="^overrides: give a list of strings"):
            call(None)  # type: ignore[arg-type]
    made = sorted(workdir.rglob("*"))
    with pytest.raises(UserError, match=r"env\['A'\]: a int; give names and values as strings"):
        api.launch(BASE, cwd=workdir, env={**hermetic_env, "A": 1})
    assert sorted(workdir.rglob("*")) == made
    # A mistyped cwd= was made, and the run trained under it.
    nowhere = workdir / "no" / "such"
    for call in (api.launch, api.sweep, api.deploy):
        with pytest.raises(UserError, match=r"cwd='.*/no/such': no such directory; give the"):
            call(["checkpoint=run"] if call is api.deploy else BASE, cwd=nowhere)
    with pytest.raises(UserError, match=r"cwd='.*/test_api.py': a file; give the directory"):
        api.launch(BASE, cwd=__file__)
    assert sorted(workdir.rglob("*")) == made
    # Nothing to serve: refused here, naming checkpoint, as the CLI refuses it (a Deployment
    # came back, whose wait_ready() said "runner deploy: ended before it served").
    for given, value in (([], r"'\?\?\?'"), (["checkpoint=null"], "'null'")):
        with pytest.raises(UserError, match=rf"^checkpoint={value}: say what to serve"):
            api.deploy(given, cwd=workdir, env=hermetic_env)
    with pytest.raises(UserError, match="runner deploy has no compute group"):
        api.deploy(["checkpoint=run", "compute=cpu"], cwd=workdir, env=hermetic_env)
    # Refused here, as the CLI refuses it: the server's process did, after a Deployment (and its
    # console file in /tmp) was returned.
    with pytest.raises(UserError, match="checkpoint='.*nosuch': no such directory: pass a"):
        api.deploy(["checkpoint=nosuch"], cwd=workdir, env=hermetic_env)
    # A handle on a directory that holds no run, or no sweep, says so (it would read `unknown`
    # and wait for ever).
    with pytest.raises(UserError, match="not a run directory"):
        api.Run(workdir)
    with pytest.raises(UserError, match="no such directory"):
        api.Sweep(workdir / "nowhere")
    # Found by the training process: the run fails with the message; its directory is gone.
    run = api.launch([*BASE, f"dataset.source={missing}"], cwd=workdir, env=hermetic_env)
    status = run.wait(timeout=300)
    assert status.state == "failed" and status.error.startswith("dataset.source="), status
    assert not run.path.exists()
    # Nothing trained: stop() said "the run is on host None; run `runner stop` there", and
    # resume() "the run is still unknown; `runner stop RUN` first".
    for call, doing in ((run.stop, "stop"), (run.resume, "resume")):
        with pytest.raises(UserError) as refused:
            call()
        assert str(refused.value) == (
            f"run='{run.path}': its launch was refused ({status.error}); nothing trained, so "
            f"nothing to {doing}: fix that and launch it again"
        )
    for command in ("stop", "resume"):  # the CLI's, on the directory
        printed = runner_cli(command, str(run.path), cwd=workdir).stderr
        assert (
            printed
            == f"error: RUN='{run.path}': no such directory; `runner runs` lists the runs here\n"
        )


def test_capabilities_and_estimate_read_what_the_cli_reads(runner_cli) -> None:
    found = api.capabilities()
    assert found.models == tuple(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
    methods = {"full", "lora", "qlora", "dpo", "lora_dpo", "qlora_dpo"}
    assert {"tiny", "hf"} <= set(found.models) and methods == set(found.methods)
    assert {"tensorboard", "wandb", "mlflow", "jsonl"} == set(found.loggers)
    assert "transformers" in found.engines and "cancelled" in found.states
    estimate = api.estimate(["compute=cpu", "method=lora", ESTIMATE_DATA])
    printed = runner_cli("estimate", "compute=cpu", "method=lora", ESTIMATE_DATA).stdout
    assert f"{estimate.parameters:,} parameters" in printed
    assert f"{estimate.trainable_parameters:,} adapter parameters" in printed


def test_the_readme_job_service_runs_a_job(
    workdir: Path, hermetic_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, hermetic_env[key])
    monkeypatch.chdir(workdir)
    service = load_script("examples/job_service")
    client = TestClient(service.app)

    refused = client.post("/jobs", json=["model=nope"])
    assert refused.status_code == 422 and "model='nope'" in refused.json()["detail"][0]
    # What a launch alone refuses is a bad request too, not a conflict (409).
    refused = client.post("/jobs", json=[*BASE, "hydra.run.dir=/elsewhere"])
    assert refused.status_code == 422 and "hydra.run.dir=" in refused.json()["detail"][0]
    created = client.post("/jobs", json=[*BASE, "max_steps=8"])
    assert created.status_code == 201, created.text
    job = created.json()["id"]
    log = client.get(f"/jobs/{job}/logs").text  # streamed until the run ends
    assert "step 8/8" in log
    assert client.get(f"/jobs/{job}").json()["state"] == "completed"
    assert [m["step"] for m in client.get(f"/jobs/{job}/metrics").json()] == list(range(1, 9))
    again = client.delete(f"/jobs/{job}")
    assert again.status_code == 409 and "already completed" in again.json()["detail"]
    assert client.get("/jobs/nope").status_code == 404


def test_a_sweep_and_a_deployment_of_its_best_run(
    seed_sweep: WaitedSweep, workdir: Path, hermetic_env: dict[str, str]
) -> None:
    sweep = seed_sweep.sweep
    summary = sweep.wait(timeout=600)
    assert summary is not None and [r["state"] for r in summary["runs"]] == ["completed"] * 2
    best = sweep.best()
    assert best is not None and best.path in [run.path for run in sweep.runs()]
    deployment = api.deploy(
        [f"checkpoint={best.path}", "port=0", "device=cpu"], cwd=workdir, env=hermetic_env
    )
    try:
        url = deployment.wait_ready(timeout=300)
        with urllib.request.urlopen(f"{url}/models", timeout=30) as response:
            models = json.load(response)
        # Named by its run (the sweep's time and job number) and step, not by its path.
        step = best.dir.latest_checkpoint()
        assert step is not None
        name = f"{best.path.parent.name}/{best.path.name}/{step.name}"
        assert [m["id"] for m in models["data"]] == [name]
    finally:
        code = deployment.stop()
    assert code == -signal.SIGTERM and "Application shutdown complete" in deployment.console()
    assert "Loading weights" not in deployment.console()  # transformers' bar, a line per model
    assert not deployment.console_path.exists()  # one was left in /tmp for every deployment


def test_a_deployment_that_ended_unseen_leaves_no_console_file(
    straight, workdir: Path, hermetic_env: dict[str, str]
) -> None:
    """A handle dropped with neither wait_ready() nor stop() left its file in /tmp."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        deployment = api.deploy(
            [f"checkpoint={straight[0].path}", f"port={port}", "device=cpu"],
            cwd=workdir,
            env=hermetic_env,
        )
        assert deployment.process.wait(timeout=120) != 0  # the port is taken
    console = deployment.console_path
    assert f"cannot listen on 127.0.0.1:{port}" in console.read_text()
    del deployment
    gc.collect()
    assert not console.exists()


def test_a_launch_under_an_output_root_of_home_and_odd_letters(
    workdir: Path, hermetic_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`~` made a directory named `~` in the caller's directory, and a root holding a comma or
    a letter outside ASCII gave the run a hydra.run.dir that Hydra's grammar refused."""
    monkeypatch.setenv("HOME", str(workdir / "home"))
    given = [*BASE, "max_steps=2", "runtime.output_root='~/my runs,é'"]
    run = api.launch(given, cwd=workdir, env=hermetic_env)
    assert run.path.is_relative_to(workdir / "home" / "my runs,é"), run.path
    final = run.wait(timeout=600)
    assert final.state == "completed", run.console()[-3000:]
    assert not (workdir / "~").exists()
    assert api.Run(f"~/{run.path.relative_to(workdir / 'home')}").status() == final
