"""What a training process knows of the launcher that started it (runner.job.launch), so that it
stops when the launcher dies (runner.trainer.process)."""

from __future__ import annotations

# The launcher's process id, in the environment of the workers it starts.
LAUNCHER_PID_ENV = "RUNNER_LAUNCHER_PID"
# prctl's option for the signal a process gets when its parent dies (<linux/prctl.h>).
PR_SET_PDEATHSIG = 1
