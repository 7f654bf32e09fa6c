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
    files = cluster_files(argv)
    if len(files) == 1:
        sys.stdout.write(next(iter(files.values())))
        return 0
    for name, text in files.items():
        what = "sbatch FILE" if name == "slurm" else "kubectl apply -f FILE"
        print(f"# ---- {name}: save as a file, then `{what}`")
        sys.stdout.write(text)
    return 0
