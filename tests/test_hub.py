"""hf:// sources through the real CLI, from a hub cache built here in huggingface_hub's layout.

Nothing reaches a hub: HF_HUB_OFFLINE=1 (hermetic_env), and the cache is written by hand the
way huggingface_hub writes it (blobs/<sha256>, snapshots/<commit>/<path> -> blob, refs/main).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote

import pytest
import torch
import yaml
from huggingface_hub import constants
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from runner.config.resolve import resolve_recipe
from runner.data.stream import START, StreamSplit
from runner.errors import UserError
from runner.hub.download import Hub, allow_patterns, default_cache_dir, localize, parse_uri
from runner.hub.token import TokenRef
from runner.job.preflight import check
from runner.models.families import FAMILIES, hf_config
from runner.models.tokenizer import ChatTokenizer
from runner.paths import ASSETS_DIR, CONF_DIR, TINY_TOKENIZER_DIR
from tests.conftest import QUICK, losses
from tests.test_config import compose_train
from tests.test_data import data as dataset_section
from tests.test_data import tokenizer, trained_text

COMMIT = "5f3e6b2c1a0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f"
MODEL = "hf://acme/tiny-llama"
DATA = "hf://acme/words"
SECRET = "hf_runnerTestSecretValue0123456789"


def cache_repo(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes]) -> Path:
    """Writes `files` into `cache` as huggingface_hub does; returns the snapshot directory."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


def tiny_checkpoint(out_dir: Path) -> None:
    """The tiny model's architecture as a Hugging Face checkpoint written by transformers.

    Its final norm is scaled up, so that its first loss is far above a random init's.
    """
    builder = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "tiny.yaml").builder)
    tokenizer = ChatTokenizer(str(TINY_TOKENIZER_DIR))
    config = hf_config(
        FAMILIES["llama3"],
        builder,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        model.model.norm.weight.fill_(50.0)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TOKENIZER_DIR / name, out_dir / name)


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, bytes]]:
    """{(repo type, repo id): {path: content}}: a tiny model and a small instruction dataset."""
    checkpoint = tmp_path_factory.mktemp("checkpoint")
    tiny_checkpoint(checkpoint)
    sample = ASSETS_DIR / "sample"
    records = (sample / "train.jsonl").read_text().splitlines(keepends=True)
    return {
        ("model", "acme/tiny-llama"): {p.name: p.read_bytes() for p in checkpoint.iterdir()},
        ("dataset", "acme/words"): {
            "README.md": b"# words\n",
            "sub/train.jsonl": "".join(records[:256]).encode(),
            "sub/validation.jsonl": (sample / "validation.jsonl").read_bytes(),
        },
    }


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory: pytest.TempPathFactory, hermetic_env, repos) -> dict[str, str]:
    """hermetic_env with its own HF_HOME whose hub cache holds `repos`, and HF_TOKEN set."""
    home = tmp_path_factory.mktemp("hf_home_filled")
    for (repo_type, repo_id), files in repos.items():
        cache_repo(home / "hub", repo_type, repo_id, files)
    env = {**hermetic_env, "HF_HOME": str(home), "HF_TOKEN": SECRET}
    env.pop("BT_RW_CACHE_DIR", None)
    return env


def cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


HUB_TRAIN = [
    f"model.source={MODEL}",
    f"model.tokenizer={MODEL}",
    f"dataset.source={DATA}/sub/train.jsonl",
    "dataset.validation.source=hf://datasets/acme/words/sub/validation.jsonl",
]


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory: pytest.TempPathFactory, hub_env) -> tuple[Path, str]:
    """A short `runner train` from the hub cache, offline, with a token in HF_TOKEN."""
    cwd = tmp_path_factory.mktemp("hub_run")
    run_dir = cwd / "run"
    quick = [
        "compute=cpu",
        "dtype=fp32",
        "runtime.progress_bar=false",
        "dataset.eval_samples=0",
        "max_steps=2",
        "batch_size=8",
        "runtime.log_every_n_steps=1",
        "runtime.save_every_n_steps=2",
    ]
    proc = cli(hub_env, cwd, "train", *HUB_TRAIN, *quick, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc.stdout + proc.stderr


def test_train_reads_model_tokenizer_and_data_from_the_hub_cache(hub_run, hub_env) -> None:
    run_dir, _ = hub_run
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    cache = Path(hub_env["HF_HOME"]) / "hub"
    model_dir = cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    data_dir = cache / "datasets--acme--words" / "snapshots" / COMMIT / "sub"
    assert recipe["model"]["source"] == str(model_dir)
    assert recipe["model"]["tokenizer"]["path"] == str(model_dir)
    assert recipe["dataset"]["source"] == str(data_dir / "train.jsonl")
    assert recipe["dataset"]["validation"]["source"] == str(data_dir / "validation.jsonl")
    assert recipe["hub_sources"] == {
        "model.source": f"hf://acme/tiny-llama@{COMMIT}",
        "model.tokenizer": f"hf://acme/tiny-llama@{COMMIT}",
        "dataset.source": f"hf://acme/words@{COMMIT}/sub/train.jsonl",
        "dataset.validation.source": f"hf://acme/words@{COMMIT}/sub/validation.jsonl",
    }
    assert "hf://" not in yaml.safe_dump({k: v for k, v in recipe.items() if k != "hub_sources"})
    # The cached weights were loaded: their scaled-up final norm makes the first loss huge,
    # where a random init starts near ln(264) = 5.6.
    assert losses(run_dir)[1] > 8.0
    assert (run_dir / "checkpoints" / "step_2" / "model.safetensors").is_file()


def test_the_token_never_lands_in_the_run_directory_or_printed_config(hub_run, hub_env) -> None:
    run_dir, output = hub_run
    assert SECRET not in output
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    printed = cli(hub_env, run_dir, "train", *HUB_TRAIN, "--cfg", "job", "--resolve")
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "hf_token: env:HF_TOKEN" in printed.stdout
    assert SECRET not in printed.stdout + printed.stderr


def test_a_token_given_by_value_is_refused_and_never_echoed(hub_env, tmp_path: Path) -> None:
    proc = cli(hub_env, tmp_path, "train", f"runtime.hf_token={SECRET}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: runtime.hf_token='<hidden>': give a reference to the token" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_offline_with_an_empty_cache_says_what_is_missing_and_how_to_get_it(
    runner_cli, hermetic_env, tmp_path: Path
) -> None:
    overrides = ["model=llama3_2_1b", "dataset=alpaca"]  # the goal line
    empty_home = tmp_path / "empty_home"
    out_root = tmp_path / "outputs"
    result = runner_cli(
        "train", *overrides, f"runtime.output_root={out_root}", env={"HF_HOME": str(empty_home)}
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    message = errors[0]
    assert message.startswith("error: model.source='hf://meta-llama/Llama-3.2-1B-Instruct': ")
    missing = (
        f"the model repo meta-llama/Llama-3.2-1B-Instruct is not in the cache {empty_home}/hub"
    )
    assert missing in message
    assert "nor is the dataset repo tatsu-lab/alpaca (dataset.source)" in message
    assert "HF_HUB_OFFLINE=1" in message
    command = " ".join(["runner download", *overrides, f"runtime.output_root={out_root}"])
    assert f"`{command}`" in message
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_local_source_passes_through_if_it_exists(tmp_path: Path) -> None:
    hub = Hub(tmp_path / "hub", TokenRef(None), (), "runner download")
    assert hub.local_path(str(tmp_path), key="model.source", repo_type="model") == tmp_path
    with pytest.raises(UserError, match="model.tokenizer='.*/nope': no such file or directory"):
        hub.local_path(str(tmp_path / "nope"), key="model.tokenizer", repo_type="model")


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://onlyorg", "give hf://org/repo"),
        ("hf://org/", "give hf://org/repo"),
        ("hf://org/name/../x", "give hf://org/repo"),
        ("hf://org/name@/x", "the revision after @ is empty"),
        ("hf://org/na me", "is not a hub repo id"),
        ("hf://models/org/name", "names a model repo; give a dataset repo"),
    ],
)
def test_malformed_uris(uri: str, expected: str) -> None:
    with pytest.raises(UserError, match="dataset.source=") as raised:
        parse_uri(uri, key="dataset.source", repo_type="dataset")
    assert expected in str(raised.value)


def test_uris_name_a_repo_a_revision_and_a_path() -> None:
    found = parse_uri("hf://tatsu-lab/alpaca@v2/data/train.parquet", key="k", repo_type="dataset")
    assert (found.repo_id, found.revision, found.path) == (
        "tatsu-lab/alpaca",
        "v2",
        "data/train.parquet",
    )
    found = parse_uri("hf://datasets/tatsu-lab/alpaca/data", key="k", repo_type="dataset")
    assert (found.repo_id, found.revision, found.path) == ("tatsu-lab/alpaca", None, "data")
    assert found.pinned("abc") == "hf://tatsu-lab/alpaca@abc/data"


@pytest.mark.parametrize(
    ("uri", "revision", "path"),
    [
        # A pull request's ref and a conversion's span slashes, as huggingface_hub reads them;
        # they read as revision `refs` and a path `pr/3/...`.
        ("hf://acme/words@refs/pr/3/sub/train.jsonl", "refs/pr/3", "sub/train.jsonl"),
        ("hf://acme/words@refs/pr/3", "refs/pr/3", ""),
        (
            "hf://datasets/acme/w@refs/convert/parquet/default/0.parquet",
            "refs/convert/parquet",
            "default/0.parquet",
        ),
        # Any other revision with a slash is written quoted, and reached the hub still quoted.
        ("hf://acme/words@feature%2Fx/a.json", "feature/x", "a.json"),
        ("hf://acme/words@refs%2Fpr%2F3", "refs/pr/3", ""),
    ],
)
def test_revisions_with_slashes(uri: str, revision: str, path: str) -> None:
    found = parse_uri(uri, key="k", repo_type="dataset")
    assert (found.repo_id.split("/")[0], found.revision, found.path) == ("acme", revision, path)


def test_a_path_with_glob_characters_is_fetched_as_named() -> None:
    """snapshot_download's allow_patterns are globs: part[1].jsonl fetched part1.jsonl."""
    from huggingface_hub.utils import filter_repo_objects

    names = ["sub/part[1].jsonl", "sub/part1.jsonl", "sub/a*b?.txt", "sub/axb1.txt"]
    for wanted in ("sub/part[1].jsonl", "sub/a*b?.txt"):
        patterns = allow_patterns(wanted)
        assert list(filter_repo_objects(names, allow_patterns=patterns)) == [wanted]
    assert list(
        filter_repo_objects(["sub/x/y.json", "subx"], allow_patterns=allow_patterns("sub"))
    ) == ["sub/x/y.json"]


def test_a_dry_run_resolves_what_is_cached_and_fetches_nothing(
    repos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # belt and braces: no hub in-process
    cache = tmp_path / "hub"
    for (repo_type, repo_id), files in repos.items():
        cache_repo(cache, repo_type, repo_id, files)
    absent = "hf://acme/absent/train.jsonl"
    cfg = compose_train(
        [f"model.source={MODEL}", f"dataset.source={absent}", f"runtime.cache_dir={cache}"]
    )
    local, pinned = localize(cfg, Hub.from_runtime(cfg.runtime, []), only_cached=True)
    assert local.model.source == str(cache / "models--acme--tiny-llama" / "snapshots" / COMMIT)
    assert local.dataset.source == absent and cfg.model.source == MODEL
    assert pinned == {"model.source": f"hf://acme/tiny-llama@{COMMIT}"}
    with pytest.raises(UserError, match="dataset repo acme/absent is not in the cache"):
        localize(cfg, Hub.from_runtime(cfg.runtime, []))


def test_estimate_leaves_an_uncached_model_on_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = "hf://acme/not-downloaded"
    cfg = compose_train([f"model.source={source}", f"runtime.cache_dir={tmp_path}"])
    recipe = resolve_recipe(cfg, tmp_path, fetch=False)
    assert recipe.model.source == source and recipe["hub_sources"] == {}
    assert list(tmp_path.iterdir()) == []


def test_the_cache_is_baseten_s_project_cache_else_hugging_face_s(monkeypatch) -> None:
    monkeypatch.setenv("BT_RW_CACHE_DIR", "/root/.cache/user_artifacts")
    assert default_cache_dir() == "/root/.cache/user_artifacts/huggingface/hub"
    monkeypatch.delenv("BT_RW_CACHE_DIR")
    assert default_cache_dir() == constants.HF_HUB_CACHE


def test_token_references(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "hf_token"
    secret_file.write_text(SECRET + "\n")
    assert TokenRef.parse(f"file:{secret_file}").read() == SECRET
    monkeypatch.setenv("MY_HUB_TOKEN", SECRET)
    assert TokenRef.parse("env:MY_HUB_TOKEN").read() == SECRET
    # A reference to nothing sends no token (False), never huggingface_hub's own (None: HF_TOKEN,
    # else the login's), another account's; env:HF_TOKEN unset is huggingface_hub's own.
    monkeypatch.setenv("HF_TOKEN", "hf_anotherAccountsToken0123456789")
    missing = TokenRef.parse("env:NO_SUCH_VARIABLE_HERE")
    assert missing.read() is False and "NO_SUCH_VARIABLE_HERE is not set" in missing.state()
    assert TokenRef.parse(f"file:{tmp_path / 'none'}").read() is False
    monkeypatch.delenv("HF_TOKEN")
    assert TokenRef.parse("env:HF_TOKEN").read() is None and TokenRef.parse(None).read() is None
    # Those two send huggingface_hub's login, where there is one: a refusal says so, where it
    # said that no token was given.
    login = tmp_path / "login_token"
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(login))
    assert TokenRef.parse("env:HF_TOKEN").state().startswith("no token was given (")
    login.write_text(SECRET)
    for ref, given in (("env:HF_TOKEN", "env:HF_TOKEN"), (None, "null")):
        assert TokenRef.parse(ref).state() == (
            f"the token of the login of `hf auth login` (runtime.hf_token={given}) has no access "
            "to it"
        )
    for raw in (SECRET, "env:", "vault:x"):
        with pytest.raises(UserError) as raised:
            TokenRef.parse(raw)
        assert SECRET not in str(raised.value)


class LoopbackHub(BaseHTTPRequestHandler):
    """The hub routes that snapshot_download and HfFileSystem use (a revision, a tree listing,
    paths-info, a file whole or in a byte range), on 127.0.0.1, with the hub's error headers.

    huggingface_hub itself turns its answers into files in the cache, into what HfFileSystem
    reads, or into its own GatedRepoError / RepositoryNotFoundError; the tests never reach the
    real hub. `requests` records each request's method, path and Range header.
    """

    repos: dict[tuple[str, str], dict[str, bytes]] = {}
    authorizations: list[str | None] = []
    requests: list[tuple[str, str, str | None]] = []
    cut_after: int | None = None  # sends only this many bytes of a file, then hangs up

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
        self.requests.append(("POST", self.path, None))
        for (repo_type, repo_id), files in self.repos.items():
            if self.path.startswith(f"/api/{repo_type}s/{repo_id}/paths-info/{COMMIT}"):
                form = parse_qs(body)
                wanted = json.loads(body)["paths"] if body.startswith("{") else form["paths"]
                return self._json([e for e in _tree(files, "", True) if e["path"] in wanted])
        return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})

    def do_GET(self) -> None:
        self.authorizations.append(self.headers.get("authorization"))
        self.requests.append((self.command, self.path, self.headers.get("range")))
        path, _, query = unquote(self.path).partition("?")
        for (repo_type, repo_id), files in self.repos.items():
            plural = f"{repo_type}s"
            web = "" if repo_type == "model" else f"/{plural}"
            info = f"/api/{plural}/{repo_id}"
            if path in (info, f"{info}/revision/main", f"{info}/revision/{COMMIT}"):
                return self._json({"id": repo_id, "sha": COMMIT})
            tree = f"/api/{plural}/{repo_id}/tree/{COMMIT}"
            if path == tree or path.startswith(f"{tree}/"):
                recursive = "recursive=true" in query.lower()
                return self._json(_tree(files, path[len(tree) + 1 :], recursive))
            if path.startswith(f"/api/{plural}/{repo_id}/revision/"):
                return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"})
            prefix = f"{web}/{repo_id}/resolve/{COMMIT}/"
            if path.startswith(prefix) and path[len(prefix) :] in files:
                return self._file(files[path[len(prefix) :]])
        if "/acme/gated" in path:
            return self._send(403, b"{}", {"X-Error-Code": "GatedRepo"})
        return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})

    def _file(self, data: bytes) -> None:
        """A file, or the bytes of its Range (as HfFileSystem reads a file: a block at a time)."""
        headers = {"X-Repo-Commit": COMMIT, "ETag": _git_oid(data), "Accept-Ranges": "bytes"}
        asked = self.headers.get("range")
        if asked is None:
            return self._send(200, data, headers)
        first, _, last = asked.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last or len(data) - 1), len(data) - 1)
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        return self._send(206, data[start : end + 1], headers)

    def _json(self, body: object) -> None:
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        if self.cut_after is not None and "ETag" in headers:
            self.wfile.write(body[: self.cut_after])
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _tree(files: dict[str, bytes], folder: str, recursive: bool) -> list[dict[str, object]]:
    """The hub's listing of `folder`: its files and folders (recursive: all below it)."""
    found: dict[str, dict[str, object]] = {}
    base = f"{folder}/" if folder else ""
    for name, data in files.items():
        if not name.startswith(base):
            continue
        parts = name[len(base) :].split("/")
        for depth in range(1, len(parts) if recursive else 1):
            below = base + "/".join(parts[:depth])
            found.setdefault(below, {"type": "directory", "path": below, "oid": "0" * 40})
        if recursive or len(parts) == 1:
            found[name] = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
        else:
            found.setdefault(
                base + parts[0], {"type": "directory", "path": base + parts[0], "oid": "0" * 40}
            )
    return list(found.values())


def _records(first: int, count: int) -> bytes:
    """JSON lines of `count` instruct records from `first` on, answer a<i>."""
    rows = [
        {"instruction": f"Reverse word {i}.", "input": "", "output": f"a{i}"}
        for i in range(first, first + count)
    ]
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


# A corpus to stream: its train split in two shards (one per process of two), and a validation
# split.
CORPUS = {
    "README.md": b"# corpus\n",
    "data/train-00000-of-00002.jsonl": _records(0, 40),
    "data/train-00001-of-00002.jsonl": _records(40, 40),
    "data/validation.jsonl": _records(80, 8),
}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def online_env(hermetic_env, repos) -> Iterator[dict[str, str]]:
    """hermetic_env online, against a loopback hub that serves `repos` and a gated repo."""
    LoopbackHub.repos = {
        **repos,
        ("dataset", "acme/corpus"): CORPUS,
        ("dataset", "acme/bad"): {
            **CORPUS,
            "data/train-00001-of-00002.jsonl": _records(40, 20)
            + b'{"instruction": "Reverse word 60.", "input": "", "output": null}\n',
        },
        ("model", "acme/tiny-llama"): {
            **repos[("model", "acme/tiny-llama")],
            "original/consolidated.00.pth": b"weights in another format",
        },
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), LoopbackHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {
        **hermetic_env,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
    }
    env.pop("HF_TOKEN", None)
    yield env
    server.shutdown()


def test_download_fills_the_cache_ahead_of_an_offline_run(online_env, tmp_path: Path) -> None:
    home, token_file = tmp_path / "hf_home", tmp_path / "secrets" / "hf_token"
    token_file.parent.mkdir()
    token_file.write_text(SECRET + "\n")
    env = {**online_env, "HF_HOME": str(home)}
    model = [f"model.source={MODEL}", f"model.tokenizer={MODEL}"]
    LoopbackHub.authorizations.clear()
    fetched = cli(
        env,
        tmp_path,
        "download",
        *model,
        f"dataset.source={DATA}/sub",  # a directory of the repo
        "dataset.streaming=true",  # fetched whole all the same, for a run off the hub
        f"runtime.hf_token=file:{token_file}",
    )
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    snapshot = home / "hub" / "models--acme--tiny-llama" / "snapshots" / COMMIT
    data = home / "hub" / "datasets--acme--words" / "snapshots" / COMMIT
    assert f"-> {snapshot}\n" in fetched.stdout and f"-> {data / 'sub'}\n" in fetched.stdout
    assert (snapshot / "model.safetensors").is_symlink()
    served = LoopbackHub.repos[("model", "acme/tiny-llama")]
    assert (snapshot / "config.json").read_bytes() == served["config.json"]
    assert not (snapshot / "original").exists()  # runtime.hub_model_ignore_patterns
    assert (data / "sub" / "validation.jsonl").is_file() and not (data / "README.md").exists()
    assert (data / "sub" / "train.jsonl").is_file()
    assert set(LoopbackHub.authorizations) == {f"Bearer {SECRET}"}
    assert SECRET not in fetched.stdout + fetched.stderr
    offline = cli({**env, "HF_HUB_OFFLINE": "1"}, tmp_path, "validate", *model, HUB_TRAIN[2])
    assert offline.returncode == 0, offline.stderr[-2000:]
    weights = f"{snapshot} (llama3) from hf://acme/tiny-llama@{COMMIT}"
    assert f"ok  weights    {weights}" in offline.stdout
    train = f"{data / 'sub' / 'train.jsonl'} [train] from hf://acme/words@{COMMIT}/sub/train.jsonl"
    assert f"ok  train      {train} (256 records)" in offline.stdout


def test_a_gated_repo_says_how_to_get_access(online_env, tmp_path: Path) -> None:
    env = {**online_env, "HF_HOME": str(tmp_path / "hf_home")}
    out_root = tmp_path / "outputs"
    overrides = ["model.source=hf://acme/gated", f"runtime.output_root={out_root}"]
    result = cli(env, tmp_path, "train", *overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: model.source='hf://acme/gated': acme/gated is gated and ")
    assert "no token was given (runtime.hf_token=env:HF_TOKEN, and HF_TOKEN is not set)" in message
    assert f"accept its licence at {online_env['HF_ENDPOINT']}/acme/gated" in message
    assert f"`runner download {' '.join(overrides)}`" in message
    assert not out_root.exists() or [p for p in out_root.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("hf://acme/nope", "the hub has no dataset repo acme/nope, or it is private"),
        (f"{DATA}/sub/test.jsonl", "acme/words has no file or directory 'sub/test.jsonl'"),
        (f"{DATA}@v9/sub/train.jsonl", "acme/words has no revision 'v9'"),
    ],
)
def test_a_missing_repo_or_file_is_named(online_env, tmp_path: Path, source, expected) -> None:
    env = {**online_env, "HF_HOME": str(tmp_path / "hf_home")}
    result = cli(env, tmp_path, "download", f"dataset.source={source}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: dataset.source='{source}': {expected}" in result.stderr


def test_a_download_cut_short_is_one_message(online_env, tmp_path: Path) -> None:
    env = {**online_env, "HF_HOME": str(tmp_path / "hf_home")}
    LoopbackHub.cut_after = 3
    try:
        result = cli(env, tmp_path, "download", f"model.source={MODEL}")
    finally:
        LoopbackHub.cut_after = None
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, result.stderr[-2000:]
    assert f"the hub ({online_env['HF_ENDPOINT']}) is out of reach" in error[0]


def test_a_cache_that_cannot_take_the_download_is_one_message(online_env, tmp_path: Path) -> None:
    """A full disk during a download was a traceback and exit 1. A file-size limit fails the
    write as a full disk does (EFBIG for ENOSPC; Python ignores SIGXFSZ)."""
    import resource

    env = {**online_env, "HF_HOME": str(tmp_path / "hf_home")}
    limit = 4096  # bytes a file may grow to: the config is smaller, the weights are not
    assert len(LoopbackHub.repos[("model", "acme/tiny-llama")]["model.safetensors"]) > limit
    result = subprocess.run(
        [sys.executable, "-m", "runner", "download", f"model.source={MODEL}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, result.stderr[-2000:]
    assert error[0].startswith(f"error: model.source='{MODEL}': the model repo acme/tiny-llama")
    cache = tmp_path / "hf_home" / "hub"
    assert f"could not be written into the cache {cache} (File too large); free space" in error[0]


STREAMED = [
    *QUICK,
    "dataset=instruct",
    "dataset.source=hf://acme/corpus/data",
    "dataset.streaming=true",
    "dataset.shuffle_buffer=16",
    "dataset.validation.split=validation",
    "dataset.eval_samples=0",
    "eval.strategy=no",
    "batch_size=4",
    "max_steps=3",
    "runtime.log_every_n_steps=1",
]


def test_a_streamed_split_is_read_from_the_hub_and_never_downloaded(
    online_env, tmp_path: Path
) -> None:
    """`runner train` reads its shard from the hub in byte ranges, with the token of the
    reference, and only the validation split (read whole) lands in the cache."""
    home, token_file = tmp_path / "hf_home", tmp_path / "hf_token"
    token_file.write_text(SECRET)
    # datasets online, without its request to S3 for each file it reads (a download count).
    env = {**online_env, "HF_HOME": str(home), "HF_DATASETS_OFFLINE": "0"}
    env["HF_UPDATE_DOWNLOAD_COUNTS"] = "0"
    overrides = [*STREAMED, f"runtime.hf_token=file:{token_file}"]
    url = f"hf://datasets/acme/corpus@{COMMIT}/data"
    LoopbackHub.requests.clear()
    LoopbackHub.authorizations.clear()
    run_dir = tmp_path / "run"
    trained = cli(env, tmp_path, "train", *overrides, f"hydra.run.dir={run_dir}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3]
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert recipe["dataset"]["source"] == url
    assert recipe["hub_sources"]["dataset.source"] == f"hf://acme/corpus@{COMMIT}/data"
    # Its 12 samples are in the first shard: read in byte ranges, never whole.
    reads = [(path, asked) for method, path, asked in LoopbackHub.requests if method == "GET"]
    shard = [asked for path, asked in reads if path.endswith("/data/train-00000-of-00002.jsonl")]
    assert shard and all(asked is not None and asked.startswith("bytes=") for asked in shard)
    assert set(LoopbackHub.authorizations) == {f"Bearer {SECRET}"}
    cached = [path for path in home.rglob("*") if path.is_file()]
    contents = {path.read_bytes() for path in cached}
    assert CORPUS["data/validation.jsonl"] in contents
    assert not {CORPUS[f"data/train-0000{n}-of-00002.jsonl"] for n in (0, 1)} & contents
    assert not [path for path in cached if "train-0000" in path.name]
    for path in [*run_dir.rglob("*"), *cached]:
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


@pytest.fixture
def hub_in_process(online_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process on the loopback hub: huggingface_hub and datasets read HF_ENDPOINT (and
    offline mode) as they are imported, so their copies are set here."""
    import datasets

    endpoint = online_env["HF_ENDPOINT"]
    template = f"{endpoint}/{{repo_id}}/resolve/{{revision}}/{{filename}}"
    for module, name, value in (
        (constants, "ENDPOINT", endpoint),
        (constants, "HUGGINGFACE_CO_URL_TEMPLATE", template),
        (constants, "HF_HUB_OFFLINE", False),
        (datasets.config, "HF_ENDPOINT", endpoint),
        (datasets.config, "HF_HUB_OFFLINE", False),
        (datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False),  # a request to S3 per file read
    ):
        monkeypatch.setattr(module, name, value)


def test_validate_says_the_split_streams_from_the_hub(hub_in_process, tmp_path: Path) -> None:
    """The recipe keeps the split on the hub at its commit; only the validation split is
    downloaded (into runtime.cache_dir), and `runner validate`'s check says it is a stream."""
    cache = tmp_path / "hub"
    cfg = compose_train([*STREAMED, f"runtime.cache_dir={cache}", "runtime.hf_token=null"])
    said: list[str] = []
    recipe, found = check(cfg, overrides=[], report=said.append)
    url = f"hf://datasets/acme/corpus@{COMMIT}/data"
    line = f"--  train      {url} [train]: a stream from the hub, its files read as it trains"
    assert [found for found in said if found.startswith(line)], said[1:]
    assert found == {"validation": 8}
    assert recipe.dataset.source == url and recipe.dataset.format == "json"  # from .jsonl
    assert recipe.hub_sources["dataset.source"] == f"hf://acme/corpus@{COMMIT}/data"
    snapshot = cache / "datasets--acme--corpus" / "snapshots" / COMMIT
    assert recipe.dataset.validation.source == str(snapshot / "data")
    files = [path.name for path in cache.rglob("*") if path.is_file() and "snapshots" in path.parts]
    assert files == ["validation.jsonl"]


def test_two_processes_stream_their_own_shards_of_a_hub_split(hub_in_process) -> None:
    """Each of two readers reads one shard from the hub (no record twice, none missed), and a
    bad record names its hub file and row."""

    def answers(repo: str, rank: int) -> set[str]:
        recipe = dataset_section(
            "dataset=instruct",
            f"dataset.source=hf://datasets/acme/{repo}@{COMMIT}/data",
            "dataset.format=jsonl",
            "dataset.streaming=true",
            "dataset.shuffle_buffer=16",
        )
        split = StreamSplit(recipe, tokenizer(), reader=rank, readers=2, seed=0)
        samples = itertools.islice(split.samples(START, lambda n: True), 40)
        return {trained_text(s, tokenizer()).removesuffix("<|eot_id|>") for s, _ in samples}

    assert [answers("corpus", rank) for rank in (0, 1)] == [
        {f"a{i}" for i in range(0, 40)},
        {f"a{i}" for i in range(40, 80)},
    ]
    bad = f"hf://datasets/acme/bad@{COMMIT}/data/train-00001-of-00002.jsonl"
    with pytest.raises(UserError, match=f"{bad} row 21, column 'output'"):
        answers("bad", 1)


def test_off_the_hub_a_stream_reads_the_cached_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_HUB_OFFLINE=1, or a hub out of reach: the copy `runner download` cached, pinned."""
    cache = tmp_path / "hub"
    cache_repo(cache, "dataset", "acme/corpus", CORPUS)
    cfg = compose_train([*STREAMED, f"runtime.cache_dir={cache}"])
    hub = Hub.from_runtime(cfg.runtime, [])
    cached = str(cache / "datasets--acme--corpus" / "snapshots" / COMMIT / "data")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert localize(cfg, hub) == (
        OmegaConf.merge(cfg, {"dataset": {"source": cached}}),
        {"dataset.source": f"hf://acme/corpus@{COMMIT}/data"},
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: closed
    local, _ = localize(cfg, hub)
    assert local.dataset.source == cached


def test_a_file_a_cache_lacks_with_the_hub_out_of_reach_is_not_called_absent(
    hub_in_process, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub out of reach: snapshot_download answers with the cached snapshot. Where the cache
    holds no tree listing of the repo (`hf download REPO FILE` writes none), it cannot say
    whether the repo has the file: a missing one was called absent from the hub ("has no file
    or directory"), sending the user to fix a path that was right. Where it holds the listing
    (a snapshot_download's, here from the loopback hub), a file not in it is absent."""
    cache = tmp_path / "hub"
    cache_repo(
        cache, "dataset", "acme/corpus", {"data/validation.jsonl": CORPUS["data/validation.jsonl"]}
    )
    hub = Hub(cache, TokenRef.parse(None), (), download_command=None)
    listed = Hub(tmp_path / "listed", TokenRef.parse(None), (), download_command=None)
    listed.fetch(parse_uri(f"{DATA}/sub/train.jsonl", key="k", repo_type="dataset"), key="k")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: closed
    source = parse_uri(
        "hf://acme/corpus/data/train-00000-of-00002.jsonl", key="k", repo_type="dataset"
    )
    with pytest.raises(UserError) as refused:
        hub.fetch(source, key="dataset.source")
    assert "is not in the cache" in str(refused.value), refused.value
    assert "the hub (http://127.0.0.1:9) is out of reach" in str(refused.value)
    with pytest.raises(UserError, match="acme/words has no file or directory 'sub/nope.jsonl'"):
        listed.fetch(parse_uri(f"{DATA}/sub/nope.jsonl", key="k", repo_type="dataset"), key="k")
