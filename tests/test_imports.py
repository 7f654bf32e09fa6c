"""The light paths stay light: `runner --help`, every `runner COMMAND --help` and `import
runner.api` load no torch, torchtune, transformers or datasets (each checked in a fresh
interpreter, as a user's shell starts one); the package's imports run one way, with no circle;
and docs/architecture.md gives that order and names every module as the tree has them."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import COMMANDS

HEAVY = ("torch", "torchtune", "transformers", "datasets")
ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _loaded_after(statement: str) -> list[str]:
    """The heavy packages in sys.modules after `statement` runs in a fresh interpreter."""
    probe = (
        f"import sys\n{statement}\n"
        "import json\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _help(argv: list[str]) -> str:
    return (
        "import contextlib, io\n"
        "from runner.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})"
    )


def test_import_of_the_python_api_loads_no_heavy_package() -> None:
    assert _loaded_after("import runner.api") == []


@pytest.mark.parametrize("argv", [["--help"], *[[name, "--help"] for name in COMMANDS]])
def test_help_loads_no_heavy_package(argv: list[str]) -> None:
    assert _loaded_after(_help(argv)) == []


def _refused(argv: list[str]) -> str:
    """`runner ARGV`, which must print its one-line refusal."""
    return (
        "import contextlib, io\n"
        "from runner.cli import main\n"
        "with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        "assert err.getvalue().startswith('error: '), err.getvalue()"
    )


@pytest.mark.parametrize("swept", ["model=tiny,nope", "optimizer.lr=1e-3,abc"])
def test_a_sweeps_mistyped_option_or_value_is_refused_before_any_heavy_import(
    swept: str, tmp_path: Path
) -> None:
    """Each job's options, keys and values are checked before any job is resolved: a sweep
    refused for its last job's mistyped value imported torch, torchtune and datasets, and
    loaded the first job's tokenizer, first (seconds, from a fresh interpreter; runner.api's
    sweep waits for that process's checks)."""
    argv = ["train", "-m", "compute=cpu", *swept.split(), f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    assert _loaded_after(_refused(argv)) == []
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("mistyped", ["optimizer.lr=abc", "batch_size=0"])
def test_a_runs_mistyped_value_is_refused_before_any_heavy_import(
    mistyped: str, tmp_path: Path
) -> None:
    """`runner train optimizer.lr=abc` imported torch (the launcher sets its threads first,
    runner.job.launch.as_launcher), and before that torchtune and datasets, 5.3 s before it
    said one line: the values are typed and bounded first, as a sweep's are."""
    argv = ["train", "compute=cpu", mistyped, f"hydra.run.dir={tmp_path / 'run'}"]
    assert _loaded_after(_refused(argv)) == []
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("data", ["missing.jsonl", "empty.jsonl", "empty.jsonl.gz"])
def test_a_runs_missing_or_empty_data_file_is_refused_before_any_heavy_import(
    data: str, tmp_path: Path
) -> None:
    """`runner train` checks its data path first: a mistyped or empty file (gzip of nothing is
    20 bytes) was refused after torch's, torchtune's and the model's imports, ten seconds."""
    if data.startswith("empty"):
        import gzip

        (tmp_path / data).write_bytes(gzip.compress(b"") if data.endswith(".gz") else b"")
    argv = ["train", f"dataset.source={tmp_path / data}", f"hydra.run.dir={tmp_path / 'run'}"]
    assert _loaded_after(_refused(argv)) == []
    assert not (tmp_path / "run").exists()


def test_deploy_of_a_checkpoint_cut_short_is_refused_before_any_heavy_import(
    tmp_path: Path,
) -> None:
    """Its files are checked before the engine's imports: `runner deploy` of weights cut short
    imported torch and transformers (seconds) before it said so."""
    from tests.fixtures import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint("llama3_2", tmp_path / "cut")
    weights = checkpoint / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert _loaded_after(_refused(["deploy", f"checkpoint={checkpoint}"])) == []


def _imported(path: Path) -> set[str]:
    """Every module that `path` imports, at its top or inside a function (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _imports(path: Path) -> set[str]:
    """The runner modules that `path` imports."""
    return {name for name in _imported(path) if name.startswith("runner.")}


def _module_graph() -> dict[str, set[str]]:
    """runner's modules (recipes/ as runner.recipes) and the runner modules each imports."""
    paths = {}
    for path in [*(ROOT / "runner").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "recipes":
            parts.insert(0, "runner")
        if parts[-1] == "__init__":
            parts.pop()
        paths[".".join(parts)] = path
    # A package's __init__ taking names from its modules (`from runner.x import y`): no circle.
    return {
        name: {m for m in _imports(path) if m in paths} - {name} for name, path in paths.items()
    }


def test_no_import_circle() -> None:
    """A module never imports one that imports it, directly or through others."""
    graph = _module_graph()

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(name for name in graph if name in reached(name))
    assert circles == []


# The folders of runner/ in the order a job flows through them (README, Architecture): a module
# imports from its own folder and from folders after its own, never before. runner.api is the
# Python front beside the CLI; errors, paths, notices, console, components and devices are the
# ground every folder stands on.
FLOW = (
    "cli",
    "api",
    "job",
    "recipes",
    "trainer",
    "export",
    "deploy",
    "config",
    "hub",
    "data",
    "models",
    "rundir",
    "components",
    "devices",
    "paths",
    "notices",
    "console",
    "errors",
)


def _folder(module: str) -> str:
    """runner.job.launch -> job; `python -m runner` (runner.__main__) is the CLI."""
    name = module.split(".")[1] if "." in module else "runner"
    return "cli" if name == "__main__" else name


def test_imports_run_down_the_flow() -> None:
    upward = sorted(
        f"{name} -> {imported}"
        for name, imports in _module_graph().items()
        for imported in imports
        if _folder(name) in FLOW and FLOW.index(_folder(imported)) < FLOW.index(_folder(name))
    )
    assert upward == []


def test_nothing_imports_the_cli() -> None:
    graph = _module_graph()
    importers = sorted(
        name
        for name, imported in graph.items()
        if _folder(name) != "cli" and any(m.startswith("runner.cli") for m in imported)
    )
    assert importers == []


def test_every_torchtune_import_goes_through_the_boundary() -> None:
    boundary = ROOT / "runner" / "models" / "torchtune_boundary.py"
    importers = [
        str(path.relative_to(ROOT))
        for path in [*(ROOT / "runner").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]
        if path != boundary and any(name.split(".")[0] == "torchtune" for name in _imported(path))
    ]
    assert importers == []


def test_architecture_page_gives_flow_as_it_is() -> None:
    """The page's sentence `... the tuple `FLOW`: `cli`, ..., `errors`.` lists FLOW, in order."""
    text = " ".join(ARCHITECTURE.read_text().split())
    found = re.search(r"the tuple `FLOW`: (.*?)\. ", text)
    assert found, "docs/architecture.md no longer gives FLOW"
    assert tuple(re.findall(r"`(\w+)`", found[1])) == FLOW


def _rows(text: str) -> dict[str, str]:
    """The page's table rows by each path their first cell names (`runner/job/`, `runner/paths.py`;
    a cell naming `runner/components.py`, `devices.py` gives runner/devices.py too)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names = re.findall(r"`([^`]+)`", first)
            folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0] else ""
            for name in names:
                rows[name if "/" in name else folder + name] = line
    return rows


def test_architecture_page_names_every_module() -> None:
    """Each module of runner/, recipes/ and scripts/ is named in the row of its folder (by its
    path from there, or its name: `kv_cache.py`, `families/gemma.py`), or by its whole path."""
    text = ARCHITECTURE.read_text()
    rows = _rows(text)
    modules = [ROOT / folder for folder in ("runner", "recipes", "scripts")]
    missing = []
    for module in sorted(m for folder in modules for m in folder.rglob("*.py")):
        path = module.relative_to(ROOT).as_posix()
        if module.name == "__init__.py" or path in rows or f"`{path}`" in text:
            continue
        parts = path.split("/")
        folders = ["/".join(parts[:i]) + "/" for i in range(len(parts) - 1, 0, -1)]
        row = next((rows[f] for f in folders if f in rows), "")
        if not any(f"`{'/'.join(parts[i:])}`" in row for i in range(1, len(parts))):
            missing.append(path)
    assert missing == [], f"docs/architecture.md names no {missing} in its folder's row"
