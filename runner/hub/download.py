"""hf:// sources: models and datasets on the Hugging Face hub, resolved to local files.

`hf://org/repo[@revision][/path]` names a repo, or a directory or single file in it (as
Kubeflow's initializers take them). Everything lands in one cache per project
(`runtime.cache_dir`), in huggingface_hub's own layout (models--org--name/snapshots/<commit>/),
so a cache filled by `hf download` serves `runner` and the other way round.
The hub token comes by reference (`runtime.hf_token`: runner.hub.token), read only when a
download asks for it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError
from runner.hub.token import TokenRef
from runner.paths import UNWRITABLE, refuse_empty_path, unwritable_fix, user_path

SCHEME = "hf://"
URI_FORM = "hf://org/repo, hf://org/repo/path/in/repo or hf://org/repo@revision/path"
# The config groups whose hf:// values name hub repos, and the kind of repo they name.
REPO_TYPES = {"model": "model", "dataset": "dataset"}
# The hub's own spelling of a repo type in a URI (hf://datasets/org/repo).
TYPE_PREFIXES = {"models": "model", "datasets": "dataset"}
# The revisions whose names hold slashes that a URI writes as they are (huggingface_hub's
# utils/_hf_uris.py: a pull request's, a parquet conversion's).
SPECIAL_REF = re.compile(r"refs/(?:convert/[\w.-]+|pr/\d+)")
# The source that dataset.streaming reads as a stream: from the hub, it is not downloaded.
STREAMED = "dataset.source"
# Local paths that nothing downstream checks before a process starts.
LOCAL_CHECKED = ("model.source", "model.tokenizer")


def default_cache_dir() -> str:
    """Baseten's read-write project cache when there is one, else huggingface_hub's own."""
    baseten = os.environ.get("BT_RW_CACHE_DIR")
    if baseten:
        return str(Path(baseten) / "huggingface" / "hub")
    return constants.HF_HUB_CACHE  # HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub


@dataclass(frozen=True)
class HubSource:
    """A parsed hf:// URI: a repo of a type, an optional revision and a path inside it."""

    uri: str
    repo_id: str
    repo_type: str
    revision: str | None
    path: str

    @property
    def web_url(self) -> str:
        """The repo's page on the hub."""
        prefix = "" if self.repo_type == "model" else "datasets/"
        return f"{constants.ENDPOINT}/{prefix}{self.repo_id}"

    def hub_url(self, commit: str) -> str:
        """This source at a fixed commit as huggingface_hub's file system names it (what a
        stream reads): hf://datasets/org/repo@<commit>[/path]."""
        return f"{SCHEME}{self.repo_type}s/{self.repo_id}@{commit}" + (
            f"/{self.path}" if self.path else ""
        )

    def pinned(self, commit: str) -> str:
        """This source at a fixed commit: hf://org/repo@<commit>[/path]."""
        return f"{SCHEME}{self.repo_id}@{commit}" + (f"/{self.path}" if self.path else "")

    def describe(self) -> str:
        """The source in words, for messages."""
        what = f"{self.repo_type} repo {self.repo_id}"
        if self.revision:
            what += f" at revision {self.revision}"
        return f"{self.path!r} in the {what}" if self.path else f"the {what}"


def is_hub_uri(value: Any) -> bool:
    """Whether a config value is an hf:// URI."""
    return isinstance(value, str) and value.startswith(SCHEME)


def parse_uri(uri: str, *, key: str, repo_type: str) -> HubSource:
    """Splits hf://org/repo[@revision][/path]; a malformed URI is a UserError naming `key`."""
    parts = uri[len(SCHEME) :].strip("/").split("/")
    if parts[0] in TYPE_PREFIXES and len(parts) >= 3:
        if TYPE_PREFIXES[parts[0]] != repo_type:
            raise UserError(
                key, uri, f"names a {TYPE_PREFIXES[parts[0]]} repo; give a {repo_type} repo"
            )
        parts = parts[1:]
    if len(parts) < 2 or "" in parts or ".." in parts:
        raise UserError(key, uri, f"give {URI_FORM}")
    name, at, revision = parts[1].partition("@")
    if at and not revision:
        raise UserError(key, uri, f"the revision after @ is empty; give {URI_FORM}")
    path = parts[2:]
    if at:
        # A pull request's or a conversion's ref spans slashes (hf://org/repo@refs/pr/3/x.json),
        # as huggingface_hub's own hf:// reader takes it; another revision with a slash in its
        # name is written with %2F (@feature%2Fx).
        special = SPECIAL_REF.match("/".join([revision, *path]))
        if special:
            path = path[special.group().count("/") :]
            revision = special.group()
        revision = unquote(revision)
    repo_id = f"{parts[0]}/{name}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UserError(key, uri, f"{repo_id!r} is not a hub repo id ({err})") from None
    return HubSource(uri, repo_id, repo_type, revision or None, "/".join(path))


class NotCachedError(UserError):
    """A hub source that is not in the cache while the hub is out of reach."""

    def __init__(self, key: str, source: HubSource, fix: str, cause: Exception | None) -> None:
        super().__init__(key, source.uri, fix)
        self.source, self.cause = source, cause


@dataclass(frozen=True)
class Hub:
    """The project's cache, the token reference, and the command that fills the cache."""

    cache_dir: Path
    token: TokenRef
    model_ignore_patterns: tuple[str, ...]
    # `runner download ...` with this run's overrides; None inside `runner download` itself.
    download_command: str | None

    @classmethod
    def from_runtime(cls, runtime: DictConfig, overrides: list[str] | None) -> Hub:
        """The hub settings of the `runtime` section."""
        refuse_empty_path(
            "runtime.cache_dir",
            runtime.cache_dir,
            "give the directory of the hub's files, or leave runtime.cache_dir out for "
            f"{default_cache_dir()}",
        )
        return cls(
            cache_dir=user_path(runtime.cache_dir),
            token=TokenRef.parse(runtime.hf_token),
            model_ignore_patterns=tuple(runtime.hub_model_ignore_patterns),
            download_command=(
                None
                if overrides is None
                else " ".join(["runner download", *(shlex.quote(o) for o in overrides)])
            ),
        )

    def local_path(self, source: str, *, key: str, repo_type: str) -> Path:
        """The local file or directory for `source`: a local path as it is, else from the cache.

        A hub source is fetched into the cache when missing and the hub is reachable; otherwise
        the UserError names `key`, the repo, what is missing and the command that fetches it.
        """
        if is_hub_uri(source):
            return self.fetch(parse_uri(source, key=key, repo_type=repo_type), key=key)[0]
        path = user_path(source)
        if not path.exists():
            raise UserError(key, source, f"no such file or directory; give a path or {URI_FORM}")
        return path.absolute()

    def fetch(self, source: HubSource, *, key: str, only_cached: bool = False) -> tuple[Path, str]:
        """(local path, commit) of a hub source: from the cache, else downloaded into it.

        The path is the cache's snapshot entry (a symlink to the blob, for a file): resolving
        it would lose the file's name.
        """
        with self.refusals(source, key):
            snapshot = Path(self._snapshot(source, only_cached))
        local = snapshot / source.path if source.path else snapshot
        if local.exists():
            return local, snapshot.name
        if constants.HF_HUB_OFFLINE or only_cached:
            raise NotCachedError(key, source, self.not_cached([(key, source)], None), None)
        if not self._listed(source, snapshot.name):
            # With the hub out of reach, snapshot_download answers with the cached snapshot,
            # which without the repo's tree listing (`hf download REPO FILE` writes none) cannot
            # say what the repo holds: asked, the hub out of reach is a NotCachedError.
            with self.refusals(source, key):
                from huggingface_hub import HfApi

                HfApi(token=self.token.read()).repo_info(
                    source.repo_id, repo_type=source.repo_type, revision=source.revision
                )
        raise self._no_path(source, key)

    def _listed(self, source: HubSource, commit: str) -> bool:
        """Whether the cache holds the hub's listing of every file of the repo at `commit`."""
        try:
            from huggingface_hub import get_cached_repo_tree
            from huggingface_hub.errors import CachedRepoTreeNotFoundError
        except ImportError:  # a huggingface_hub older than its listing's cache: none is known
            return False
        try:
            get_cached_repo_tree(
                source.repo_id,
                repo_type=source.repo_type,
                revision=commit,
                cache_dir=self.cache_dir,
            )
        except CachedRepoTreeNotFoundError:
            return False
        return True

    def stream(self, source: HubSource, *, key: str) -> tuple[str | Path, str]:
        """(hf://datasets/org/repo@<commit>/path, commit) of a dataset source to stream: the
        revision resolved and the path found on the hub, nothing downloaded. Where the hub is
        out of reach, the cached copy's path (fetch): a UserError if there is none."""
        from huggingface_hub import HfApi, HfFileSystem

        token = self.token.read()
        # refusals turns the HTTP client's errors into a NotCachedError; others are OSErrors.
        off_the_hub: tuple[type[Exception], ...] = (NotCachedError, *out_of_reach())
        try:
            with self.refusals(source, key):
                info = HfApi(token=token).repo_info(
                    source.repo_id, repo_type=source.repo_type, revision=source.revision
                )
                url = source.hub_url(str(info.sha))
                found = HfFileSystem(token=token).exists(url)
        except off_the_hub:
            return self.fetch(source, key=key, only_cached=True)
        if not found:
            raise self._no_path(source, key)
        return url, str(info.sha)

    @contextlib.contextmanager
    def refusals(self, source: HubSource, key: str) -> Iterator[None]:
        """huggingface_hub's errors about `source` as UserErrors naming `key` and the fix."""
        try:
            yield
        except GatedRepoError as err:
            raise UserError(key, source.uri, self._gated(source)) from err
        except RepositoryNotFoundError as err:
            raise UserError(key, source.uri, self._not_found(source)) from err
        except RevisionNotFoundError as err:
            raise UserError(
                key,
                source.uri,
                f"{source.repo_id} has no revision {source.revision!r}; {self._tree(source)}",
            ) from err
        except LocalEntryNotFoundError as err:
            fix = self.not_cached([(key, source)], err)
            raise NotCachedError(key, source, fix, err) from err
        except HfHubHTTPError as err:
            raise UserError(key, source.uri, self._refused(source, err)) from err
        except _transport_errors() as err:  # the hub out of reach, or a download cut short
            raise NotCachedError(key, source, self.not_cached([(key, source)], err), err) from err
        except OSError as err:
            if err.errno not in UNWRITABLE:
                raise
            raise UserError(
                key,
                source.uri,
                f"{source.describe()} could not be written into the cache {self.cache_dir} "
                + unwritable_fix(err, "runtime.cache_dir"),
            ) from None

    def _no_path(self, source: HubSource, key: str) -> UserError:
        return UserError(
            key,
            source.uri,
            f"{source.repo_id} has no file or directory {source.path!r}; {self._tree(source)}",
        )

    def _snapshot(self, source: HubSource, only_cached: bool) -> str:
        patterns = allow_patterns(source.path) if source.path else None
        # A whole model repo skips what training never reads; a path asked for is taken as it is.
        whole_model = source.repo_type == "model" and not source.path
        ignore = list(self.model_ignore_patterns) if whole_model else None
        return snapshot_download(
            source.repo_id,
            repo_type=source.repo_type,
            revision=source.revision,
            cache_dir=self.cache_dir,
            token=self.token.read(),
            allow_patterns=patterns,
            ignore_patterns=ignore,
            local_files_only=only_cached,
        )

    def _then_fetch(self) -> str:
        if self.download_command is None:
            return "then run this command again"
        return f"then fetch it with `{self.download_command}`"

    def _gated(self, source: HubSource) -> str:
        return (
            f"{source.repo_id} is gated and {self.token.state()}; accept its licence at "
            f"{source.web_url} with your hub account, give a token of that account by reference "
            "(export HF_TOKEN=<token> for runtime.hf_token=env:HF_TOKEN, or "
            f"runtime.hf_token=file:/run/secrets/hf_token), {self._then_fetch()}"
        )

    def _not_found(self, source: HubSource) -> str:
        return (
            f"the hub has no {source.repo_type} repo {source.repo_id}, or it is private and "
            f"{self.token.state()}; check the name at {source.web_url}, or give a token with "
            "access by reference (runtime.hf_token=env:NAME or file:PATH)"
        )

    def _refused(self, source: HubSource, err: HfHubHTTPError) -> str:
        status = err.response.status_code if err.response is not None else "?"
        return (
            f"the hub refused {source.describe()} (HTTP {status}) and it is not in the cache "
            f"{self.cache_dir}; {self.token.state()}; give a valid token by reference "
            f"(runtime.hf_token), {self._then_fetch()}"
        )

    def _tree(self, source: HubSource) -> str:
        return f"see {source.web_url}/tree/{source.revision or 'main'} for what it holds"

    def not_cached(self, missing: list[tuple[str, HubSource]], err: Exception | None) -> str:
        """What is missing from the cache, why the hub is out of reach, what fetches it."""
        first = f"{missing[0][1].describe()} is not in the cache {self.cache_dir}"
        others = "".join(f", nor is {source.describe()} ({key})" for key, source in missing[1:])
        it = "them" if len(missing) > 1 else "it"
        elsewhere = f"run this where the hub is reachable and copy the cache to {self.cache_dir}"
        if constants.HF_HUB_OFFLINE:
            reason, how = "HF_HUB_OFFLINE=1 keeps runner off the hub", "unset HF_HUB_OFFLINE"
            elsewhere = f"{how}, or {elsewhere}"
        else:
            cause = err.__cause__ if err is not None and err.__cause__ is not None else err
            reason = f"the hub ({constants.ENDPOINT}) is out of reach ({type(cause).__name__})"
            how = "check the network"
        if self.download_command is None:
            return f"{first}{others}, and {reason}; {elsewhere}"
        return (
            f"{first}{others}, and {reason}; fetch {it} with `{self.download_command}` where "
            f"the hub is reachable, into the same cache (runtime.cache_dir, BT_RW_CACHE_DIR or "
            f"HF_HOME), or {how}"
        )


def allow_patterns(path: str) -> list[str]:
    """snapshot_download's allow_patterns for a file or directory `path` of a repo: fnmatch
    globs, in which the name's own `[`, `*` and `?` are escaped (part[1].jsonl matched
    part1.jsonl, and not itself)."""
    literal = re.sub(r"([\[*?])", r"[\1]", path)
    return [literal, f"{literal}/*"]


def out_of_reach() -> tuple[type[Exception], ...]:
    """The errors that mean the hub is out of reach (or a transfer broke off): OSError and
    those of the HTTP client, which huggingface_hub lets through as they are."""
    return (OSError, *_transport_errors())


def _transport_errors() -> tuple[type[Exception], ...]:
    """The transport errors of whichever HTTP client this huggingface_hub imported (httpx,
    httpx2; requests' are OSErrors)."""
    clients = (sys.modules.get(name) for name in ("httpx", "httpx2"))
    return tuple(client.TransportError for client in clients if client is not None)


def hub_values(cfg: DictConfig) -> Iterator[tuple[str, str, str]]:
    """(key, value, repo type) for each hf:// value under the model and dataset groups."""

    def walk(node: Any, key: str) -> Iterator[tuple[str, Any]]:
        """(key, value) of every leaf under `node`."""
        if isinstance(node, dict):
            for name, value in node.items():
                yield from walk(value, f"{key}.{name}")
        else:
            yield key, node

    for group, repo_type in REPO_TYPES.items():
        if group not in cfg:
            continue
        for key, value in walk(OmegaConf.to_container(cfg[group], resolve=True), group):
            values = value if isinstance(value, list) else [value]
            if any(is_hub_uri(v) for v in values):
                yield key, value, repo_type


def localize(
    cfg: DictConfig, hub: Hub, only_cached: bool = False, stream: bool = True
) -> tuple[DictConfig, dict[str, str]]:
    """A copy of `cfg` with each hf:// source replaced by its local path in the cache.

    Returns the copy and {key: the hf:// URI pinned to the commit it resolved to}. Every source
    missing from the cache of a machine off the hub is named in one message. only_cached (for
    a dry run that must not download, like `runner estimate`) resolves what is cached and
    leaves the other hf:// values as they are. With `stream`, a training split read as a
    stream (dataset.streaming) is left on the hub, at its commit (Hub.stream): its files are
    read from there as it trains, except where the hub is out of reach and it is cached.
    """
    local = copy.deepcopy(cfg)
    pinned: dict[str, str] = {}
    missing: list[NotCachedError] = []
    streamed = STREAMED if stream and OmegaConf.select(cfg, "dataset.streaming") else None
    for key, value, repo_type in hub_values(cfg):
        found = []
        for item in value if isinstance(value, list) else [value]:
            if not is_hub_uri(item):
                found.append(item)
                continue
            source = parse_uri(item, key=key, repo_type=repo_type)
            try:
                if key == streamed and not constants.HF_HUB_OFFLINE:
                    path, commit = hub.stream(source, key=key)
                else:
                    path, commit = hub.fetch(source, key=key, only_cached=only_cached)
            except NotCachedError as err:
                if only_cached:
                    found.append(item)
                else:
                    missing.append(err)
                continue
            found.append(str(path))
            pinned[key] = source.pinned(commit)
        if not missing:
            resolved = found if isinstance(value, list) else found[0]
            OmegaConf.update(local, key, resolved, merge=False)
    if missing:
        first = missing[0]
        fix = hub.not_cached([(e.key, e.source) for e in missing], first.cause)
        raise NotCachedError(first.key, first.source, fix, first.cause)
    if streamed and str(OmegaConf.select(local, streamed)).startswith(f"{SCHEME}datasets/"):
        _streamed_from_the_hub(local, hub, pinned, download=not only_cached)
    for key in LOCAL_CHECKED:
        value = OmegaConf.select(local, key)
        if value is not None and not is_hub_uri(value):
            hub.local_path(value, key=key, repo_type="model")
    return local, pinned


def _streamed_from_the_hub(
    local: DictConfig, hub: Hub, pinned: dict[str, str], *, download: bool
) -> None:
    """What the hub's listing decides for a training split streamed from it: dataset.format
    where it is null, and a validation split named of the same source, which is read whole:
    its files alone are downloaded (with `download`) and read from the cache."""
    from runner.data.sources import source_format, split_files  # datasets: not for --help

    data, token = local.dataset, hub.token.read()
    data.format = source_format(STREAMED, data.source, data.format, token)
    held = data.validation
    if held.source is not None or held.split is None or not download:
        return
    files = split_files(STREAMED, data.source, data.format, token)
    names = [part.strip().split("[")[0] for part in str(held.split).split("+")]
    if any(name not in files for name in names):
        raise UserError(
            "dataset.validation.split",
            held.split,
            f"{pinned[STREAMED]} has the split(s) {sorted(files)}: name one of them",
        )
    source = parse_uri(pinned[STREAMED], key=STREAMED, repo_type="dataset")
    commit = str(source.revision)
    repo = f"{SCHEME}datasets/{source.repo_id}@{commit}"
    wanted = [file.removeprefix(f"{repo}/") for name in names for file in files[name]]
    # Its dataset card too, whose configs: may be what named the files a split (split_files).
    wanted.append(f"{source.path}/README.md" if source.path else "README.md")
    with hub.refusals(source, STREAMED):
        snapshot = snapshot_download(
            source.repo_id,
            repo_type="dataset",
            revision=commit,
            cache_dir=hub.cache_dir,
            token=token,
            allow_patterns=wanted,
        )
    held.source = str(Path(snapshot) / source.path)
    pinned["dataset.validation.source"] = pinned[STREAMED]


def download(cfg: DictConfig) -> None:
    """Fetches every hf:// source the typed config (runner.config.schema.typed) names into the
    cache; prints where."""
    hub = Hub.from_runtime(cfg.runtime, overrides=None)
    found = list(hub_values(cfg))
    if not found:
        print("nothing to download: every model and dataset source is local (or random init)")
        return
    # Everything, a streamed split too: what this command fetches, an offline run reads.
    local, pinned = localize(cfg, hub, stream=False)
    for key, value, _ in found:
        print(f"{key:<24} {pinned.get(key, value)}\n{'':<24} -> {OmegaConf.select(local, key)}")
    print(f"cache: {hub.cache_dir}")
