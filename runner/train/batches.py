"""The training data in optimizer steps: this rank's share of each epoch, in groups of
micro-batches (one group per optimizer step), from the saved position onwards."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from runner.train.parallel import Placement

Batch = dict[str, torch.Tensor]


class EpochBatches:
    """Epochs of a dataset in global batches of batch_size x ranks x accumulation samples.

    The position (epoch, micro-batches of this rank done in it) advances as groups are taken,
    and goes into every checkpoint, so that a resumed run continues with the next sample.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        collate: Callable[[list[dict[str, Any]]], Batch],
        place: Placement,
        *,
        batch_size: int,
        accumulation: int,
        epochs: int,
        seed: int,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.num_workers = num_workers
        self.collate = collate
        self.world_size = place.world_size
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.epochs = epochs
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=place.world_size, rank=place.rank, shuffle=True, seed=seed
        )
        assert isinstance(dataset, Sized)
        self.steps_per_epoch = len(dataset) // (batch_size * place.world_size * accumulation)
        if self.steps_per_epoch == 0:
            raise ValueError("the dataset is smaller than one global batch")
        self.epoch = 0
        self.batches_done_in_epoch = 0

    def __iter__(self) -> Iterator[list[Batch]]:
        """Lists of micro-batches (one list per optimizer step) from the saved position."""
        while self.epoch < self.epochs:
            self.sampler.set_epoch(self.epoch)
            per_rank = self.steps_per_epoch * self.accumulation * self.batch_size
            indices = list(self.sampler)[:per_rank]
            start = self.batches_done_in_epoch * self.batch_size
            loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                sampler=indices[start:],
                collate_fn=self.collate,
                num_workers=self.num_workers,
                worker_init_fn=_leave_signals_to_the_trainer,
                # Its own generator: a new iterator draws a seed from it, and drawing from the
                # global RNG would shift dropout after a resume (which restores that RNG).
                generator=torch.Generator(),
            )
            group = []
            for batch in loader:
                group.append(batch)
                if len(group) == self.accumulation:
                    self.batches_done_in_epoch += self.accumulation
                    yield group
                    group = []
            self.epoch += 1
            self.batches_done_in_epoch = 0

    def position(self) -> dict[str, int]:
        """The training state's data position."""
        return {
            "epoch": self.epoch,
            "batches_done_in_epoch": self.batches_done_in_epoch,
            # The data position in samples of the global order, whatever the world size.
            "samples_done_in_epoch": self.batches_done_in_epoch * self.batch_size * self.world_size,
        }

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Continues from a training state's position (written at any world size)."""
        self.epoch = state["epoch"]
        # Micro-batches of this rank: checkpoints move between world sizes at one global batch.
        per_micro_batch = self.batch_size * self.world_size
        if state["samples_done_in_epoch"] % per_micro_batch:
            raise ValueError(
                f"{checkpoint} stopped {state['samples_done_in_epoch']} samples into an epoch, "
                f"not a multiple of batch_size x world size = {per_micro_batch}; resume with "
                "the global batch it was written with"
            )
        self.batches_done_in_epoch = state["samples_done_in_epoch"] // per_micro_batch


def _leave_signals_to_the_trainer(_worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT: `runner stop` signals the launcher's whole
    process group and Ctrl-C the terminal's, and a worker killed by either would fail the
    training process's next batch before it saves its checkpoint. The trainer ends its workers
    as it exits (and each ends on its own when the trainer is gone)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
