"""Data files as runner reads them itself: a local source checked (there, readable, not empty),
a local file or a hub file (read in ranges), a compressed one decompressed; XML parsed into
records; and, where a file does not read, the line and column at fault. Light: `runner train`
checks its data path with it before torch and `datasets` load."""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from runner.errors import UserError
from runner.paths import refuse_empty_path, user_path

# A data file compressed (data.jsonl.gz), read decompressed, as `datasets` reads it: fsspec
# infers the compression from the extension.
COMPRESSED = (".gz", ".bz2", ".xz")


# A dataset repo's file or directory pinned to a commit, as runner.hub.download streams it.
HUB_STREAM = re.compile(r"^hf://datasets/[^/@]+/[^/@]+@[0-9a-f]{40}(/|$)")


def is_remote(source: str) -> bool:
    """Whether `source` is a hub file or directory streamed from the hub (HUB_STREAM)."""
    return HUB_STREAM.match(source) is not None


FORMATS: dict[str, tuple[str, ...]] = {
    "json": (".json", ".jsonl"),
    "jsonl": (".json", ".jsonl"),
    "csv": (".csv",),
    "parquet": (".parquet",),
    "arrow": (".arrow",),
    "text": (".txt",),
    "xml": (".xml",),
}


def local_source(key: str, source: str) -> str:
    """The absolute local path of a dataset source: a data file or a directory of them.

    runner.hub.download has already turned hf:// sources into paths in the cache (or, for a
    streamed training split, into the hub's URL at a commit: kept as it is), except for a dry run
    that downloads nothing (`runner estimate`).
    """
    if is_remote(source):
        return source
    if source.startswith("hf://"):
        raise UserError(
            key,
            source,
            "is not in the cache and this command downloads nothing; fetch it with "
            "`runner download` and the same overrides",
        )
    refuse_empty_path(key, source, f"give a data file ({data_extensions()}) or a directory of them")
    path = user_path(source)
    if not path.exists():
        raise UserError(
            key,
            source,
            f"no such file or directory; give a data file ({data_extensions()}) or a directory "
            "of them",
        )
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        # Another user's, on a shared disk: the read that failed later was a traceback.
        raise UserError(key, source, f"this user (uid {os.getuid()}) may not read it")
    if path.is_file() and is_empty(str(path)):
        raise no_records(key, source, [source])
    # Not resolve(): a file in the hub cache is a symlink to a blob without its name.
    return os.path.abspath(path)


def data_extensions(formats: tuple[str, ...] = tuple(FORMATS)) -> str:
    return ", ".join(sorted({ext for f in formats for ext in FORMATS[f]}))


def no_records(key: str, source: str, files: list[str]) -> UserError:
    if files == [source]:
        return UserError(key, source, "has no records; give a data file that holds some")
    return UserError(
        key, source, f"its files {', '.join(files)} hold no records; give files that hold some"
    )


def hub_files(token: str | bool | None) -> Any:
    """huggingface_hub's file system (HF_ENDPOINT's hub), with the token (TokenRef.read)."""
    from huggingface_hub import HfFileSystem, constants

    # The endpoint named: a file system is cached by its arguments, and HF_ENDPOINT may differ.
    return HfFileSystem(token=token, endpoint=constants.ENDPOINT)


def open_data(file: str, token: str | bool | None = None, mode: str = "rb", **options: Any) -> Any:
    """A local file, or a hub file read in ranges as it is read (nothing cached on disk); a
    compressed one (COMPRESSED) decompressed."""
    import fsspec

    files = hub_files(token) if is_remote(file) else fsspec.filesystem("file")
    return files.open(file, mode, compression="infer", **options)


def _size(file: str, token: str | bool | None) -> int:
    return int(hub_files(token).size(file)) if is_remote(file) else os.path.getsize(file)


def is_empty(file: str, token: str | bool | None = None) -> bool:
    """Whether a data file holds no byte: a compressed one decompressed (gzip of nothing is 20
    bytes, which `datasets` then stopped on with a StopIteration)."""
    if Path(file).suffix.lower() in COMPRESSED:
        with open_data(file, token) as f:
            return not f.read(1)
    return _size(file, token) == 0


def data_suffix(path: Path) -> str:
    """A data file's extension: a compressed one's (data.jsonl.gz) the one before it."""
    suffix = path.suffix.lower()
    return Path(path.stem).suffix.lower() if suffix in COMPRESSED else suffix


def xml_rows(key: str, source: str, file: str, record: str | None) -> list[dict[str, str]]:
    try:
        with open_data(file, None) as f:
            root = ElementTree.parse(f).getroot()
    except ElementTree.ParseError as err:
        found = _undecodable_line(file)
        if found is None:
            line, column = err.position
            problem = f"not well-formed XML ({str(err).split(':')[0]})"
            found = line, column + 1, problem, "fix the XML there"
        line, column, problem, fix = found
        raise LineError(
            key, source, file=file, line=line, column=column, problem=problem, fix=fix
        ) from None
    # A file with a default namespace (<root xmlns="...">) had no <item>, its fields named
    # "{http://...}instruction": a record is matched by its local name too, and its fields in
    # its own namespace go by theirs; another namespace's keep their full names (<meta:output>
    # beside <output> is another field).
    elements = (
        list(root)
        if record is None
        else [e for e in root.iter() if record in (e.tag, e.tag.rpartition("}")[2])]
    )
    if not elements and len(root):
        children = ", ".join(dict.fromkeys(f"<{child.tag.rpartition('}')[2]}>" for child in root))
        raise UserError(
            "dataset.xml.record",
            record,
            f"{file} has no <{record}> element (its root's children are {children}); give the "
            "name of a record's element, or null (each child of the root a record)",
        )
    return [
        {
            **element.attrib,  # an attribute's name has no default namespace
            **{_in_own(child.tag, element.tag): "".join(child.itertext()) for child in element},
        }
        for element in elements
    ]


def _in_own(name: str, record: str) -> str:
    """An XML name without its namespace where it is the record element's own."""
    space = record[: record.index("}") + 1] if record.startswith("{") else ""
    return name.removeprefix(space) if space else name


class LineError(UserError):
    """A data file that does not read: names the file, the line and the column (from 1)."""

    def __init__(
        self, key: str, source: str, *, file: str, line: int, column: int, problem: str, fix: str
    ) -> None:
        self.file, self.line, self.column = file, line, column
        where = "" if file == source else f"{file} "  # the file is the value already
        super().__init__(key, source, f"{where}line {line}, column {column}: {problem}; {fix}")


def read_error(
    key: str,
    source: str,
    data_format: str,
    files: list[str],
    err: Exception,
    token: str | bool | None = None,
) -> UserError:
    """What `datasets` could not read: the file, line and column at fault where a line of a text
    format is found that is not UTF-8 (or not JSON), else the reader's own message. A hub file
    is read again from the hub to find them."""
    if data_format not in ("parquet", "arrow"):
        for file in files:
            found = _undecodable_line(file, token)
            if found is None and data_format in ("json", "jsonl"):
                found = _unparsable_json(file, token)
            if found is not None:
                line, column, problem, fix = found
                return LineError(
                    key, source, file=file, line=line, column=column, problem=problem, fix=fix
                )
    cause = err.__cause__ or err
    return UserError(key, source, f"could not be read as dataset.format={data_format} ({cause})")


def _undecodable_line(
    file: str, token: str | bool | None = None
) -> tuple[int, int, str, str] | None:
    """(line, column, problem, fix) of the first line of `file` that is not UTF-8 text."""
    with open_data(file, token) as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                column = len(raw[: err.start].decode("utf-8")) + 1
                problem = f"byte {raw[err.start]:#04x} is not UTF-8 text"
                return number, column, problem, "save the file as UTF-8, or fix or drop the line"
    return None


def _unparsable_json(
    file: str, token: str | bool | None = None
) -> tuple[int, int, str, str] | None:
    """(line, column, problem, fix) of the first line of a JSON-lines file that is not one JSON
    object; for a file that is one JSON document (a list of records), where it stops parsing."""
    fix = "fix or drop the line (a JSON-lines file holds one JSON object a line)"
    with open_data(file, token, "r", encoding="utf-8-sig") as f:
        lines = ((number, line) for number, line in enumerate(f, 1) if line.strip())
        first = next(lines, None)
        if first is None:
            return None
        if not first[1].lstrip().startswith("["):
            for number, line in itertools.chain([first], lines):
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as err:
                    if number == first[0]:
                        break  # perhaps one JSON document over several lines: read below
                    return number, err.colno, _json_problem(err), fix
                if not isinstance(value, dict):
                    return number, 1, f"holds {json.dumps(value)[:40]}, not a JSON object", fix
            else:
                return None
        f.seek(0)
        try:
            json.load(f)
        except json.JSONDecodeError as err:
            return err.lineno, err.colno, _json_problem(err), "fix the JSON there"
    return None


def _json_problem(err: json.JSONDecodeError) -> str:
    # Some of json's messages end in "at", before the position it adds (given here apart).
    return f"not valid JSON ({err.msg.removesuffix(' at')})"
