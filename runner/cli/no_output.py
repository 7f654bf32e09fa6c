"""Overrides under which Hydra writes nothing: the commands that only look (validate, estimate,
download) leave no run directory and no log file."""

NO_OUTPUT = [
    "hydra.output_subdir=null",
    "hydra.run.dir=.",
    "hydra/job_logging=disabled",
    "hydra/hydra_logging=disabled",
]
