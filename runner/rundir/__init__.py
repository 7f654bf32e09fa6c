"""The run directory contract (docs/run-directory.md): the status record, metrics, whole
checkpoints, and the sweeps made of run directories.

The names other modules use, from the modules that define them: io (atomic writes),
checkpoint_files (a checkpoint's files and their checks), status (status.json), run (RunDir),
sweeps (a sweep's runs and its best), lock (the run lock every process of a run holds),
liveness (the heartbeat).
"""

# A face: every name is imported to be imported from here, none to be used here.
# ruff: noqa: F401

from __future__ import annotations

from runner.rundir.checkpoint_files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
    HF_CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILES,
    TRAINING_STATE_FILE,
    check_safetensors,
    checkpoint_problem,
    eos_token_ids,
    is_checkpoint_dir,
    json_problem,
    no_training_state,
    read_generation_config,
    readable_as_umask,
    weight_files,
)
from runner.rundir.io import write_json_atomic, write_text_atomic
from runner.rundir.liveness import Heartbeat
from runner.rundir.lock import (
    SWEEP_LOCK_FILE,
    RunLocked,
    held_here,
    hold_until_exit,
    join_run_lock,
    lock_held,
    pid_alive,
    pid_stopped,
    run_lock,
)
from runner.rundir.run import (
    BASE_MODEL_DIR,
    CHECKPOINTS_DIR,
    LOG_FILE,
    RECIPE_FILE,
    TRACKERS_FILE,
    RunDir,
    checkpoint_step,
    is_run_dir,
    lora_base,
    own_base,
    run_around,
)
from runner.rundir.status import (
    ACTIVE_STATES,
    FINAL_STATES,
    STALLED,
    STATES,
    STATUS_FILE,
    STATUS_VERSION,
    STOPPING,
    Status,
)
from runner.rundir.sweeps import (
    SUMMARY_JSON,
    SWEEP_MARKERS,
    best_run,
    is_sweep_dir,
    its_jobs_instead,
    sweep_runs,
)
