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

configs: capabilities, compose, validate, estimate (in this process); runs: launch, runs, Run,
LogStream, sweep, Sweep; deployments: deploy, Deployment; processes: the detached processes they
start and read.
"""

from __future__ import annotations

from runner.api.configs import Capabilities, capabilities, compose, estimate, validate
from runner.api.deployments import Deployment, deploy
from runner.api.runs import LogStream, Run, Sweep, launch, runs, sweep

__all__ = [
    "Capabilities",
    "Deployment",
    "LogStream",
    "Run",
    "Sweep",
    "capabilities",
    "compose",
    "deploy",
    "estimate",
    "launch",
    "runs",
    "sweep",
    "validate",
]
