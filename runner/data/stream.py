"""A training split read as a stream (dataset.streaming): records as they come, never the whole
split in memory or in a cache; from the hub (a source hf://datasets/org/repo@<commit>/path), the
files are read in ranges from the hub, never downloaded whole.

The split's files are read in order, one chunk at a time. Each reader (a rank) reads its own
files where they divide evenly among the readers (a sharded corpus: no rank reads another's), and
otherwise takes every `readers`-th record of them all from its own offset; either way no two
ranks see the same record. A reader cuts its share into windows of dataset.shuffle_buffer
records, checks each window as the map-style checks check a whole split (a bad record names its
file and row), and shuffles it (seeded by the seed, the pass over the data, the reader and the
window). Its DataLoader workers each read the rank's whole share and tokenize only the samples
of their own batches, so the batches are the same with any number of workers. Where a reader is
in its share is a Position: the pass, the window and the next sample in it. A resumed reader
reads its share up to that window again (reading, not tokenizing), then continues with that
sample: the same records in the same order as had it never stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow as pa

from runner.data.checks import checked_records
from runner.data.sources import Records, stream_files, stream_records
from runner.errors import UserError

if TYPE_CHECKING:
    from runner.models.tokenizer import ChatTokenizer

# (pass over the data, window of the reader's share in it, next sample of the window).
Position = tuple[int, int, int]
START: Position = (0, 0, 0)
# A record and where it is: (file, row from 1, record).
Located = tuple[str, int, dict[str, Any]]


@dataclass
class WindowRecords(Records):
    """A window's records; `rows` names the file and row of each."""

    rows: list[tuple[str, int]] = field(default_factory=list)

    def where(self, index: int) -> tuple[str, int]:
        if self.kept is not None:
            index = int(self.kept[index])
        return self.rows[index]


class StreamSplit:
    """One reader's share of the training split, as samples with the position after each."""

    def __init__(
        self,
        data: Mapping[str, Any],
        tokenizer: ChatTokenizer,
        *,
        reader: int,
        readers: int,
        seed: int,
        token: str | bool | None = None,
    ) -> None:
        self.data, self.tokenizer = data, tokenizer
        self.reader, self.readers, self.seed = reader, readers, seed
        self.window = data["shuffle_buffer"]
        # The hub token, for a split streamed from the hub (TokenRef.read: None, its login).
        self.token = token
        self.files = stream_files(
            "dataset.source", data["source"], data["format"], "dataset.split", data["split"], token
        )

    def _windows(self) -> Iterator[list[Located]]:
        """This reader's share of one pass over the split, in windows: its own files where they
        divide evenly among the readers (it reads no other), else every readers-th record."""
        by_file = len(self.files) % self.readers == 0
        files = self.files[self.reader :: self.readers] if by_file else self.files
        share: list[Located] = []
        index = 0
        for file in files:
            records = stream_records(
                "dataset.source", self.data["source"], self.data["format"], file, self.token
            )
            for row, record in enumerate(records, 1):
                if by_file or index % self.readers == self.reader:
                    share.append((file, row, record))
                    if len(share) == self.window:
                        yield share
                        share = []
                index += 1
        if share:
            yield share

    def _shuffled(self, window: list[Located], epoch: int, number: int) -> tuple[Any, Any]:
        """A window's records checked, as a split tokenized on access, and their shuffled order
        (None, [] where only blank text is left)."""
        order = np.random.default_rng([self.seed, epoch, self.reader, number])
        split = self._checked(window)
        if split is None:
            return None, []
        return split, order.permutation(len(split))

    def _checked(self, window: list[Located]) -> Any:
        """The window's records checked as a split is; None where only blank text is left."""
        rows = [record for _, _, record in window]
        try:
            table = datasets.Dataset.from_list(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Values of one column that disagree in type, across records or inside one (a
            # number beside text in a conversation): held as JSON, as the whole-split read of a
            # JSON file holds them, so that the checks name the first bad record.
            table = datasets.Dataset.from_list(rows, on_mixed_types="use_json")
        records = WindowRecords(
            table,
            self.data["source"],
            self.data["format"],
            parts=[],
            rows=[(file, row) for file, row, _ in window],
        )
        return checked_records(records, self.data, self.tokenizer, key="dataset.source")

    def samples(
        self, position: Position, wanted: Callable[[int], bool]
    ) -> Iterator[tuple[dict[str, Any] | None, Position]]:
        """Samples from `position` on, pass after pass, each with the position after it; the
        n-th from `position` (from 0) is tokenized where wanted(n), else given as None."""
        epoch, start_window, start_index = position
        count = 0
        while True:
            fresh = (start_window, start_index) == (0, 0)
            produced = False
            for number, window in enumerate(self._windows()):
                if number < start_window:
                    continue
                split, order = self._shuffled(window, epoch, number)
                first = start_index if number == start_window else 0
                for index in range(first, len(order)):
                    produced = True
                    sample = split[int(order[index])] if wanted(count) else None
                    count += 1
                    yield sample, (epoch, number, index + 1)
            if fresh and not produced:
                raise UserError(
                    "dataset.source",
                    self.data["source"],
                    f"process {self.reader + 1} of {self.readers} got no sample in a whole pass: "
                    "the split has fewer records than processes; give more data or fewer "
                    "processes",
                )
            epoch, start_window, start_index = epoch + 1, 0, 0
