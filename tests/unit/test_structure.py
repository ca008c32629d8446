"""The product apart from its harness: what is installed, what it imports, and what a vLLM host needs.

- The wheel holds ``rollout_sync`` and ``vllm_plugin``; ``benchmarks`` (top level, with the forwarder of its
  old name ``rollout_sync.bench``) and ``testbed`` (what tests, examples and benchmarks share) are not
  installed.
- No product module imports ``testbed``, ``tests`` or the benchmarks.
- ``vllm_plugin`` imports without DeepSpeed: a vLLM host installs ``rollout-sync[rollout]`` only.
- Folders import downward only, in one strict order (pure core, transport, handshake, sync, the two
  sides, the vLLM plugin, integrations): no loops between folders, and ``shapes`` is a leaf.
- No two product modules share a name.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("rollout_sync", "vllm_plugin")
NOT_PRODUCT = ("rollout_sync/bench",)
HARNESS = ("testbed", "tests", "benchmarks", "rollout_sync.bench")


def _product_files() -> list[Path]:
    files = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not any(rel.startswith(prefix + "/") for prefix in NOT_PRODUCT):
                files.append(path)
    return files


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved), at any depth of the file."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]  # a module's or __init__'s package
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_no_product_module_imports_the_testbed_the_tests_or_the_benchmarks() -> None:
    offenders = {
        path.relative_to(ROOT).as_posix(): sorted(
            m for m in _imported_modules(path) if any(m == h or m.startswith(h + ".") for h in HARNESS)
        )
        for path in _product_files()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# Folders from the bottom up; a module imports its own folder and folders of lower levels only (two folders of
# one level, like the two sides, never import each other). ``rollout_sync/__init__.py`` (the public API,
# re-exported lazily) is exempt.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("errors", "tiny"),
    ("layout",),
    ("shapes",),  # a leaf: the shape tables know no side
    ("geometry", "planning"),
    ("interop",),
    ("transport/core",),
    ("transport/same_host", "transport/delta", "transport/nixl"),
    ("transport",),
    ("handshake",),
    ("sync",),
    ("trainer", "rollout"),
    ("vllm_plugin",),
    ("scale",),
    ("integrations",),
    ("cli",),
)
LEVEL = {folder: i for i, folders in enumerate(LEVELS) for folder in folders}


def _folder(module: str) -> str | None:
    """The folder of a product module (``rollout_sync.transport.delta.run`` → ``transport/delta``)."""
    parts = module.split(".")
    if parts[0] == "vllm_plugin":
        return "vllm_plugin"
    if parts[0] != "rollout_sync" or len(parts) < 2:
        return None
    if (
        parts[1] == "transport"
        and len(parts) > 2
        and (ROOT / "rollout_sync" / "transport" / parts[2]).is_dir()
    ):
        return f"transport/{parts[2]}"
    return parts[1]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_folders_import_downward_only() -> None:
    wrong: dict[str, list[str]] = {}
    for path in _product_files():
        if path == ROOT / "rollout_sync" / "__init__.py":
            continue
        own = _folder(_module_of(path) + ("._" if path.name == "__init__.py" else ""))
        assert own in LEVEL, f"{path.relative_to(ROOT)}: folder {own!r} has no level in LEVELS"
        for module in _imported_modules(path):
            other = _folder(module)
            if other is None or other == own:
                continue
            if other not in LEVEL or LEVEL[other] >= LEVEL[own]:
                wrong.setdefault(path.relative_to(ROOT).as_posix(), []).append(module)
    assert wrong == {}


def test_no_two_product_modules_share_a_name() -> None:
    by_name: dict[str, list[str]] = {}
    for path in _product_files():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


_IMPORT_PLUGIN = """
import importlib.util, sys
assert importlib.util.find_spec("deepspeed") is None, "deepspeed is still importable"
import vllm_plugin
import vllm_plugin.extension
import vllm_plugin.registration
import vllm_plugin.weight_transfer
import vllm_plugin.worker_link
import rollout_sync.rollout.group_link
loaded = sorted(m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed."))
print("deepspeed modules:", loaded)
sys.exit(1 if loaded else 0)
"""


def test_the_vllm_plugin_imports_on_a_host_without_deepspeed(tmp_path: Path) -> None:
    # An environment without DeepSpeed: this one's site-packages less DeepSpeed (links to every other
    # entry), with no site processing, so neither ``import`` nor ``importlib.metadata`` can find it.
    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "site-packages"
    farm.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith("deepspeed"):
            (farm / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(farm)])
    done = subprocess.run(
        [sys.executable, "-S", "-c", _IMPORT_PLUGIN],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deepspeed modules: []" in done.stdout


def test_the_wheel_holds_the_product_only(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout: the wheel is built from its tracked files")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    source = tmp_path / "source"
    for rel in filter(None, tracked.split("\0")):
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [
            sys.executable,
            *("-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"),
            *("-w", str(wheels), str(source)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"rollout_sync", "vllm_plugin"}
    assert [n for n in names if n.startswith("rollout_sync/bench/")] == []
    assert "rollout_sync/planning/plan.py" in names and "vllm_plugin/extension.py" in names
