"""`runner cluster [overrides]`: print a multi-node run's Slurm script and Kubeflow TrainJob."""

from __future__ import annotations

import sys

from runner.job.cluster import USAGE, cluster_files
from runner.paths import CONF_DIR


def main(argv: list[str]) -> int:
    """Entry point of `runner cluster`."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + (CONF_DIR / "cluster.yaml").read_text())
        return 0
    from runner.cli import _check_group_choices
    from runner.config.secrets import refuse_typed_secrets

    # runner train's own checks of what is typed: the line is every node's, and a secret in it
    # would be written into the script, Slurm's copy of it and the TrainJob object.
    _check_group_choices("train", argv)  # every node runs runner train
    refuse_typed_secrets(argv)
    files = cluster_files(argv)
    if len(files) == 1:
        sys.stdout.write(next(iter(files.values())))
        return 0
    for name, text in files.items():
        what = "sbatch FILE" if name == "slurm" else "kubectl apply -f FILE"
        print(f"# ---- {name}: save as a file, then `{what}`")
        sys.stdout.write(text)
    return 0
