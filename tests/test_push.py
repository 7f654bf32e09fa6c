"""Publishing to a hub: `runner export ... push_to=hf://...` and `runner push`, against a loopback
hub that speaks the upload protocol huggingface_hub uses (repo creation, branches, preupload,
the LFS batch API, commits). HF_HUB_DISABLE_XET=1 keeps the client on the LFS protocol: Xet
storage needs the hub's CAS service, which a loopback server does not have.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from runner.errors import UserError
from tests.cli_forks import Forked, ForkedCli
from tests.conftest import QUICK
from tests.test_hub import LoopbackHub, _git_oid, cli

SECRET = "hf_pushTestSecretValue0123456789"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class UploadHub(LoopbackHub):
    """test_hub's loopback hub, taking uploads: repos in memory, {repo id: {"private": bool,
    "branches": {name: {path: bytes}}}}."""

    uploaded: dict[str, dict] = {}
    lfs: dict[str, bytes] = {}
    lfs_puts: list[str] = []
    authorizations: set[str | None] = set()
    fail_commits = 0

    def do_POST(self) -> None:
        self.authorizations.add(self.headers.get("authorization"))
        path, body = self.path.split("?")[0], self._body()
        if path == "/api/repos/create":
            request = json.loads(body)
            repo_id = f"{request['organization']}/{request['name']}"
            if repo_id in self.uploaded:
                url = f"{self._endpoint()}/{repo_id}"  # as the hub answers
                return self._json({"error": "You already created this model repo", "url": url}, 409)
            private = request.get("visibility") == "private"
            self.uploaded[repo_id] = {"private": private, "branches": {"main": {}}}
            return self._json({"url": f"{self._endpoint()}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":
            return self._json({})
        if path.endswith(".git/info/lfs/objects/batch"):
            return self._lfs_batch(json.loads(body))
        parts = path.split("/")  # /api/models/org/name/<verb>/<revision>
        repo = self.uploaded.get(f"{parts[3]}/{parts[4]}") if len(parts) > 6 else None
        if repo is None:
            return self._json(
                {"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"}
            )
        verb, revision = parts[5], parts[6]
        if verb == "branch":
            if revision in repo["branches"]:
                return self._json({"error": "branch exists"}, 409)
            repo["branches"][revision] = dict(repo["branches"]["main"])
            return self._json({})
        if verb == "preupload":
            files = repo["branches"].get(revision, {})
            answer = [self._upload_mode(f["path"], files) for f in json.loads(body)["files"]]
            return self._json({"files": answer, "commitOid": "0" * 40})
        if verb == "commit":
            return self._commit(repo, revision, body)
        return self._json({"error": f"no route {path}"}, 404)

    def do_PUT(self) -> None:
        oid = self.path.rsplit("/", 1)[-1]
        data = self._body()
        assert hashlib.sha256(data).hexdigest() == oid
        self.lfs[oid] = data
        self.lfs_puts.append(oid)
        self._send(200, b"", {})

    def _upload_mode(self, path: str, files: dict[str, bytes]) -> dict:
        lfs = path.endswith(LFS_SUFFIXES)
        there = files.get(path)
        oid = None
        if there is not None:
            oid = hashlib.sha256(there).hexdigest() if lfs else _git_oid(there)
        mode = "lfs" if lfs else "regular"
        return {"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid}

    def _lfs_batch(self, request: dict) -> None:
        objects = []
        for item in request["objects"]:
            answer = {"oid": item["oid"], "size": item["size"]}
            if item["oid"] not in self.lfs:
                href = f"{self._endpoint()}/lfs-upload/{item['oid']}"
                answer["actions"] = {"upload": {"href": href}}
            objects.append(answer)
        self._json({"transfer": "basic", "objects": objects})

    def _commit(self, repo: dict, revision: str, body: bytes) -> None:
        if UploadHub.fail_commits:
            UploadHub.fail_commits -= 1
            return self._json({"error": "the hub is busy, try again"}, 500)
        files = dict(repo["branches"][revision])
        for line in body.decode().splitlines():
            entry = json.loads(line)
            value = entry["value"]
            if entry["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif entry["key"] == "lfsFile":
                files[value["path"]] = self.lfs[value["oid"]]
        repo["branches"][revision] = files
        sha = hashlib.sha1(repr(sorted(files)).encode()).hexdigest()
        url = f"{self._endpoint()}/{self.path.split('/')[3]}/{self.path.split('/')[4]}"
        self._json({"commitUrl": f"{url}/commit/{sha}", "commitOid": sha})

    def _endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _body(self) -> bytes:
        data = self.rfile.read(int(self.headers.get("content-length", 0)))
        return gzip.decompress(data) if self.headers.get("content-encoding") == "gzip" else data

    def _json(self, body: object, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self._send(status, data, {"Content-Type": "application/json", **(headers or {})})


class Hub:
    """The loopback hub's server, which a test can take out of reach and bring back on its port."""

    def __init__(self) -> None:
        self._start(0)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _start(self, port: int) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), UploadHub)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """Nothing listens on the hub's port inside the block (a connection is refused)."""
        self.stop()
        try:
            yield
        finally:
            self._start(int(self.endpoint.rsplit(":", 1)[1]))


@pytest.fixture(scope="module")
def hub() -> Iterator[Hub]:
    hub = Hub()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def hub_env(hermetic_env, hub: Hub) -> dict[str, str]:
    return {
        **hermetic_env,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_ENDPOINT": hub.endpoint,
        "PUSH_TOKEN": SECRET,
    }


@pytest.fixture(scope="module")
def hub_cli(hub_env: dict[str, str]) -> Iterator[Callable[..., Forked]]:
    """`hub_cli(cwd, *args)`: `runner ARGS` in hub_env, forked from a CLI server of its own
    (tests/cli_forks.py) that imported torch and huggingface_hub once, with hub_env's endpoint
    and token (read at import), sparing each command a fresh interpreter's imports. A command
    in another environment (another HF_HUB_OFFLINE or HF_TOKEN) runs in a fresh one (`cli`)."""
    server = ForkedCli(hub_env)
    yield lambda cwd, *args: server(list(args), cwd, timeout_s=600)
    server.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli) -> Path:
    run = tmp_path_factory.mktemp("push") / "run"
    argv = ["train", *QUICK, "max_steps=4", "eval.strategy=no", f"hydra.run.dir={run}"]
    trained = forked_cli(argv, run.parent, timeout_s=600)
    assert trained.returncode == 0, trained.stderr[-2000:]
    return run


@pytest.fixture(scope="module")
def exported(
    hub_cli, run_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Forked]:
    """`runner export format=merged push_to=hf://acme/pushed` of the run: the export's folder,
    which the tests below push again, and the command's outcome."""
    cwd = tmp_path_factory.mktemp("exported")
    out = cwd / "merged"
    result = hub_cli(
        cwd,
        "export",
        f"checkpoint={run_dir}",
        "format=merged",
        f"out={out}",
        "push_to=hf://acme/pushed",
        "hf_token=env:PUSH_TOKEN",
    )
    return out, result


def test_export_push_to_lands_in_a_private_repo_with_its_model_card(hub_env, exported) -> None:
    out, result = exported
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].startswith(
        f"{hub_env['HF_ENDPOINT']}/acme/pushed/commit/"
    )
    repo = UploadHub.uploaded["acme/pushed"]
    files = repo["branches"]["main"]
    assert repo["private"]
    for local in out.iterdir():
        assert files[local.name] == local.read_bytes(), local.name
    assert hashlib.sha256(files["model.safetensors"]).hexdigest() in UploadHub.lfs  # via LFS
    card = files["README.md"].decode()
    assert card.startswith("---\nlibrary_name: transformers\n") and "  - full\n" in card
    assert "| learning rate |" in card and "- training loss " in card
    assert "runner train compute=cpu dtype=fp32" in card and "max_steps=4" in card
    assert f"Bearer {SECRET}" in UploadHub.authorizations
    assert SECRET not in result.stdout + result.stderr
    assert not any(SECRET.encode() in p.read_bytes() for p in out.iterdir())


def test_a_push_cut_short_resumes_without_sending_the_weights_again(
    hub_cli, exported, tmp_path: Path
) -> None:
    out, pushed = exported
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    UploadHub.lfs.clear()  # the export pushed the same weights
    UploadHub.lfs_puts.clear()
    UploadHub.fail_commits = 1
    argv = ["push", str(out), "hf://acme/resumed@dev", "--public", "--hf-token", "env:PUSH_TOKEN"]
    cut = hub_cli(tmp_path, *argv)
    assert cut.returncode == 2, cut.stderr[-2000:]
    error = [line for line in cut.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "HTTP 500" in error[0] and "Traceback" not in cut.stderr
    # The push it repeats: its visibility and token too (without them, a retry made the repo
    # private and sent HF_TOKEN's token).
    again = f"runner push {out} hf://acme/resumed@dev --public --hf-token env:PUSH_TOKEN"
    assert f"`{again}` pushes again" in error[0], error[0]
    weights = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert UploadHub.lfs_puts == [weights]  # uploaded before the commit failed
    again = hub_cli(tmp_path, *argv)
    assert again.returncode == 0, again.stderr[-2000:]
    assert UploadHub.lfs_puts == [weights]  # not sent again
    repo = UploadHub.uploaded["acme/resumed"]
    assert not repo["private"] and repo["branches"]["main"] == {}
    assert repo["branches"]["dev"]["model.safetensors"] == (out / "model.safetensors").read_bytes()


def test_a_checkpoint_is_pushed_without_its_optimizer_state(
    hub_cli, run_dir: Path, tmp_path: Path
) -> None:
    checkpoint = run_dir / "checkpoints" / "step_4"
    argv = ["push", str(checkpoint), "hf://acme/checkpoint", "--hf-token", "env:PUSH_TOKEN"]
    result = hub_cli(tmp_path, *argv)
    assert result.returncode == 0, result.stderr[-2000:]
    files = UploadHub.uploaded["acme/checkpoint"]["branches"]["main"]
    kept = {p.name for p in checkpoint.iterdir()} - {"training_state.pt"}
    assert (checkpoint / "training_state.pt").is_file() and set(files) == kept | {"README.md"}
    assert files["model.safetensors"] == (checkpoint / "model.safetensors").read_bytes()


def test_a_run_or_sweep_dir_is_refused_naming_the_checkpoint_to_push(
    hub_cli, run_dir: Path, tmp_path: Path
) -> None:
    """A run dir would upload every checkpoint with its optimizer state, the heartbeat, status
    and logs: refused by name before any upload, pointing at its latest checkpoint."""
    target = "hf://acme/whole-run"

    def refused(path: Path) -> str:
        argv = ["push", str(path), target, "--hf-token", "env:PUSH_TOKEN"]
        result = hub_cli(tmp_path, *argv)
        assert result.returncode == 2, result.stderr[-2000:]
        error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(error) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert error[0].startswith(f"error: path='{path}': "), error[0]
        return error[0]

    latest = run_dir / "checkpoints" / "step_4"
    assert latest.is_dir()
    for path in (run_dir, run_dir / "checkpoints"):
        error = refused(path)
        assert f"push its latest checkpoint, `runner push {latest} {target}`" in error
        assert f"`runner export checkpoint={run_dir} push_to={target}`" in error
    sweep = tmp_path / "sweep"
    shutil.copytree(run_dir, sweep / "0")
    (sweep / "multirun.yaml").write_text("{}")  # as Hydra's sweeper writes it
    error = refused(sweep)
    assert "a sweep dir, not a model" in error
    assert f"`runner export checkpoint={sweep} push_to={target}`" in error
    ended = tmp_path / "ended"  # a run whose checkpoints were removed: none will come
    shutil.copytree(run_dir, ended, ignore=lambda folder, names: ["checkpoints"])
    assert "the run ended completed with no whole checkpoint" in refused(ended)
    assert "acme/whole-run" not in UploadHub.uploaded


def test_push_names_a_target_left_out_or_mistyped_as_to(
    hub_cli, run_dir: Path, tmp_path: Path
) -> None:
    checkpoint = str(run_dir / "checkpoints" / "step_4")
    for target, message in (
        ([], "error: to: missing: give to (usage: runner push "),
        # One slash short: the repo is not cme/tiny.
        (["hf:/acme/tiny"], "error: to='hf:/acme/tiny': give hf://org/name[@branch]"),
        (["acme/tiny"], "error: to='acme/tiny': give hf://org/name[@branch]"),
        # No repo name: the forms push takes, not those a download takes (a path in a repo).
        (
            ["hf://acme"],
            "error: to='hf://acme': name a model repo and optionally a branch: "
            "hf://org/name[@branch]\n",
        ),
    ):
        argv = ["push", checkpoint, *target, "--hf-token", "env:PUSH_TOKEN"]
        result = hub_cli(tmp_path, *argv)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith(message) and "None" not in result.stderr, result.stderr
    assert not {"cme/tiny", "acme/tiny"} & set(UploadHub.uploaded)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("push_to=acme/model", "push_to='acme/model'"),
        ("push_to=hf://acme/model/sub", "hf://org/name[@branch]"),
        (f"hf_token={SECRET}", "never the token itself"),
    ],
)
def test_a_bad_push_is_refused_before_anything_is_written(
    hub_cli, run_dir: Path, tmp_path: Path, override: str, expected: str
) -> None:
    out = tmp_path / "merged"
    argv = ["export", f"checkpoint={run_dir}", f"out={out}", "push_to=hf://acme/x", override]
    result = hub_cli(tmp_path, *argv)
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and expected in error[0], result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert not out.exists()


def test_a_push_to_a_hub_out_of_reach_is_one_message(
    hub: Hub, hub_env, hub_cli, exported, run_dir: Path, tmp_path: Path
) -> None:
    out, _ = exported
    endpoint = hub_env["HF_ENDPOINT"]
    # Each command names the target by its own name for it: push's `to`, export's `push_to`.
    for argv, named in (
        (["push", str(out), "hf://acme/x", "--hf-token", "env:PUSH_TOKEN"], "to='hf://acme/x'"),
        (
            ["export", f"checkpoint={run_dir}", f"out={tmp_path / 'y'}", "push_to=hf://acme/y"],
            "push_to='hf://acme/y'",
        ),
    ):
        with hub.down():  # a loopback port that nothing listens on
            result = hub_cli(tmp_path, *argv)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr, result.stderr[-2000:]
        error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(error) == 1 and error[0].startswith(f"error: {named}: "), error
        assert f"the hub ({endpoint}) is out of reach" in error[0], error
        assert "check the network" in error[0] and "pushes again" in error[0]
    # Offline by choice: not the network's fault, said before anything is exported.
    offline = {**hub_env, "HF_HUB_OFFLINE": "1"}
    result = cli(offline, tmp_path, "push", str(out), "hf://acme/x")
    assert result.returncode == 2 and result.stderr == (
        "error: to='hf://acme/x': HF_HUB_OFFLINE=1 keeps runner off the hub; unset "
        "HF_HUB_OFFLINE to push\n"
    ), result.stderr[-2000:]
    argv = ["export", f"checkpoint={run_dir}", f"out={tmp_path / 'z'}", "push_to=hf://acme/z"]
    result = cli(offline, tmp_path, *argv)
    assert result.returncode == 2 and "HF_HUB_OFFLINE=1 keeps runner off" in result.stderr
    assert not (tmp_path / "z").exists()


def test_a_token_reference_to_nothing_is_refused_not_replaced_by_another(
    hub_env, run_dir: Path, tmp_path: Path
) -> None:
    """`--hf-token env:ORG_TOKEN` unset (or a file: that is not there) pushed with HF_TOKEN's
    token, another account's, through huggingface_hub's fallback for a token of None."""
    personal = "hf_personalTokenOfAnotherAccount0123"
    env = {**hub_env, "HF_TOKEN": personal}
    checkpoint = str(run_dir / "checkpoints" / "step_4")
    # (A file: reference to no file reads as nothing too: tests/test_hub.py's token test.)
    argv = ["push", checkpoint, "hf://acme/org-model", "--hf-token", "env:ORG_TOKEN"]
    result = cli(env, tmp_path, *argv)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: --hf-token='env:ORG_TOKEN': no token was given (")
    out = tmp_path / "merged"
    argv = ["export", f"checkpoint={run_dir}", f"out={out}", "push_to=hf://acme/org-model"]
    result = cli(env, tmp_path, *argv, "hf_token=env:ORG_TOKEN")
    assert result.returncode == 2 and "error: hf_token='env:ORG_TOKEN': no token" in result.stderr
    assert not out.exists() and "acme/org-model" not in UploadHub.uploaded
    assert f"Bearer {personal}" not in UploadHub.authorizations


def test_the_card_and_adapter_config_describe_the_model_pushed(tmp_path: Path, capsys) -> None:
    """The card gave the run's last loss and evaluation for an earlier checkpoint's weights; a
    LoRA adapter's config named its base by the training machine's cache path."""
    from runner.hub.download import parse_uri
    from runner.hub.push import _adapter_config, model_card
    from runner.rundir import RunDir

    run = RunDir(tmp_path / "run")
    (run.path / "checkpoints" / "step_2").mkdir(parents=True)
    run.write_status("completed", step=4)
    for step, loss in ((1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0)):
        run.append_metrics({"step": step, "loss": loss})
    run.append_metrics({"step": 2, "eval_loss": 4.5})
    run.append_metrics({"step": 4, "eval_loss": 2.5})
    target = parse_uri("hf://acme/x", key="to", repo_type="model")
    card = model_card(run.path, target, {}, run, step=2)
    assert "- training loss 4.0000 at step 2" in card and "- at step 2: eval_loss 4.5000" in card
    assert "at step 4" not in card and "2.0000" not in card
    # A manifest.json cut short is named, where the card's Reproduce section was a traceback.
    (run.path / "manifest.json").write_text('{"overrides": ["max_st')
    with pytest.raises(UserError, match="manifest.json: cannot be read"):
        model_card(run.path, target, {}, run, step=2)

    sha = "5f3e6b2c" * 5
    snapshot = f"/cache/hub/models--acme--tiny-llama/snapshots/{sha}"
    local = tmp_path / "adapter_config.json"
    local.write_text(json.dumps({"base_model_name_or_path": snapshot, "r": 8}))
    hub = {"hub_sources": {"model.source": f"hf://acme/tiny-llama@{sha}"}}
    pushed = json.loads(_adapter_config(local, hub))
    assert pushed == {"base_model_name_or_path": "acme/tiny-llama", "revision": sha, "r": 8}
    assert json.loads(local.read_text())["base_model_name_or_path"] == snapshot  # left alone
    assert json.loads(_adapter_config(local, {}))["base_model_name_or_path"] == snapshot
    assert "a local path; whoever loads it from the hub gives the base" in capsys.readouterr().err


def test_a_path_given_as_a_key_names_the_form_push_takes(runner_cli) -> None:
    """`runner push checkpoint=DIR ...`, as deploy and export take a checkpoint, was "no such
    file" of the word `checkpoint=DIR` and no more."""
    result = runner_cli("push", "checkpoint=outputs/run", "to=hf://acme/tiny")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        "error: path='checkpoint=outputs/run': no such file or directory: give an export's path "
        "as it is, not as a key: runner push PATH hf://org/name\n"
    )
