"""Starts the recipe: in this process, or under torch.distributed's elastic agent."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any

RECIPE_MODULE = "runner.recipes.full_finetune"


def launch(recipe: dict[str, Any], recipe_path: Path) -> dict[str, Any] | None:
    """Runs the recipe; one process runs in-process, more go through elastic_launch.

    Returns the recipe's result when it ran in this process.
    """
    os.environ.update(recipe["runtime"]["env"])
    world_size = recipe["nproc_per_node"] * recipe["nnodes"]
    if world_size == 1:
        from runner.recipes.full_finetune import run

        return run(recipe_path)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=recipe["nnodes"],
        max_nodes=recipe["nnodes"],
        nproc_per_node=recipe["nproc_per_node"],
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.5,
    )
    elastic_launch(config, entrypoint=sys.executable)("-m", RECIPE_MODULE, str(recipe_path))
    return None
