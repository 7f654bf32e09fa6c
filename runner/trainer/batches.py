"""The training data in optimizer steps: this rank's share of each epoch (EpochBatches) or of a
stream (StreamBatches), in groups of micro-batches (one group per optimizer step), from the
saved position onwards."""

from __future__ import annotations

import contextlib
import errno
import shutil
import signal
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

from runner.data.stream import START, Position, StreamSplit
from runner.errors import UserError
from runner.trainer.parallel import Placement
from runner.trainer.parent import STOP_SIGNALS

# Where a loader's workers put the batches they pass to the trainer (POSIX shared memory).
SHARED_MEMORY = Path("/dev/shm")

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
        if self.steps_per_epoch == 0:  # packs fewer than a batch (records are checked before)
            raise UserError(
                "batch_size",
                batch_size,
                f"the training split makes {len(dataset)} rows, fewer than one global batch of "
                f"{batch_size * place.world_size * accumulation}; lower batch_size or add records",
            )
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
            with _shared_memory(self.num_workers):
                for batch in loader:
                    group.append(batch)
                    if len(group) == self.accumulation:
                        self.batches_done_in_epoch += self.accumulation
                        yield group
                        group = []
            self.epoch += 1
            self.batches_done_in_epoch = 0

    def steps_left(self) -> int:
        """The optimizer steps __iter__ yields from the position: fewer than the run's steps
        where the position was saved on other data (a file grown since: a later epoch)."""
        if self.epoch >= self.epochs:
            return 0
        batches = self.steps_per_epoch * self.accumulation - self.batches_done_in_epoch
        this_epoch = max(batches, 0) // self.accumulation
        return this_epoch + (self.epochs - self.epoch - 1) * self.steps_per_epoch

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
        if "stream" in state:
            raise UserError(
                "dataset.streaming",
                False,
                f"{checkpoint} was written by a run that read its data as a stream; resume it "
                "with dataset.streaming=true",
            )
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


# The stream reader of a rank: StreamSplit(reader=rank, readers=world size) of the split.
MakeReader = Callable[[int, int], StreamSplit]


class _RankStream(IterableDataset[tuple[Batch, Position]]):
    """This rank's micro-batches from `position` (where an iteration starts: StreamBatches moves
    it on as the batches are trained) on, each with the position after it. With K DataLoader
    workers, worker w makes the batches w, w + K, ... (counted from `position`, as the loader
    takes them in turn from worker 0): each reads the rank's whole share and tokenizes only its
    own batches' samples."""

    def __init__(
        self,
        make_reader: MakeReader,
        collate: Callable[[list[dict[str, Any]]], Batch],
        place: Placement,
        *,
        batch_size: int,
    ) -> None:
        self.make_reader, self.collate, self.batch_size = make_reader, collate, batch_size
        self.rank, self.world_size = place.rank, place.world_size
        self.position: Position = START

    def __iter__(self) -> Iterator[tuple[Batch, Position]]:
        worker = get_worker_info()
        workers, me = (worker.num_workers, worker.id) if worker is not None else (1, 0)

        def mine(count: int) -> bool:
            return (count // self.batch_size) % workers == me

        reader = self.make_reader(self.rank, self.world_size)
        pending: list[dict[str, Any]] = []
        for count, (sample, position) in enumerate(reader.samples(self.position, mine)):
            if sample is not None:
                pending.append(sample)
            if (count + 1) % self.batch_size == 0 and pending:
                yield self.collate(pending), position
                pending = []


class StreamBatches:
    """A stream in global batches of batch_size x ranks x accumulation samples, max_steps of
    them (a stream has no length). The position of each rank's reader
    (runner.data.stream.Position) goes into every checkpoint, so that a resumed run reads on
    from the next sample of each, on as many processes (with any number of workers)."""

    def __init__(
        self,
        make_reader: MakeReader,
        collate: Callable[[list[dict[str, Any]]], Batch],
        place: Placement,
        *,
        batch_size: int,
        accumulation: int,
        max_steps: int,
        num_workers: int,
    ) -> None:
        self.place, self.accumulation, self.num_workers = place, accumulation, num_workers
        self.stream = _RankStream(make_reader, collate, place, batch_size=batch_size)
        # One "epoch": the run (evaluation by epoch is refused for a stream).
        self.steps_per_epoch = max_steps

    def __iter__(self) -> Iterator[list[Batch]]:
        loader = DataLoader(
            self.stream,
            batch_size=None,
            num_workers=self.num_workers,
            worker_init_fn=_leave_signals_to_the_trainer,
        )
        group = []
        with _shared_memory(self.num_workers):
            for batch, position in loader:
                group.append(batch)
                if len(group) == self.accumulation:
                    self.stream.position = (position[0], position[1], position[2])
                    yield group
                    group = []

    def position(self) -> dict[str, Any]:
        """The training state's stream position: each rank's reader's (every rank joins)."""
        gathered: list[Any] = [list(self.stream.position)]
        if self.place.world_size > 1:
            gathered = [None] * self.place.world_size
            dist.all_gather_object(gathered, list(self.stream.position))
        return {"stream": gathered}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Continues each rank's reader from its position (as many processes only)."""
        if "stream" not in state:
            raise UserError(
                "dataset.streaming",
                True,
                f"{checkpoint} was written by a run that read its data whole; resume it with "
                "dataset.streaming=false",
            )
        saved = state["stream"]
        if len(saved) != self.place.world_size:
            raise UserError(
                "compute.nproc_per_node",
                self.place.world_size,
                f"{checkpoint} read its stream with {len(saved)} process(es), each its own share "
                "of the records; resume it on as many",
            )
        epoch, window, index = saved[self.place.rank]
        self.stream.position = (epoch, window, index)


@contextlib.contextmanager
def _shared_memory(num_workers: int) -> Iterator[None]:
    """A loader's workers pass their batches through /dev/shm: one without room for them
    (a container's, 64 MB by default in Docker) failed the run with a bare ENOSPC, naming
    neither. Only the loader's own work runs inside: the trainer's runs between its yields."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        full = getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)
        if not num_workers or not full:
            raise
        free = shutil.disk_usage(SHARED_MEMORY).free // 2**20 if SHARED_MEMORY.is_dir() else 0
        raise UserError(
            "dataset.num_workers",
            num_workers,
            f"its workers pass batches through {SHARED_MEMORY}, which has no room for them "
            f"({free} MiB free; {err}); give dataset.num_workers=0, or more shared memory (a "
            "container's --shm-size)",
        ) from None


def _leave_signals_to_the_trainer(_worker_id: int) -> None:
    """A loader worker ignores the stop signals: `runner stop` signals the launcher's whole
    process group, Ctrl-C and a closed terminal's SIGHUP the terminal's, and a worker killed by
    one would fail the training process's next batch before it saves its checkpoint. The
    trainer ends its workers as it exits (and each ends on its own when the trainer is gone)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
