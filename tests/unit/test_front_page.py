"""The README as a front page, its results tables as data, and the public API it imports from.

- The README stays a front page (at most 250 lines); its relative links name files that exist (the docs
  pages' links are checked by ``mkdocs build --strict`` in ``scripts/test.sh``).
- The results tables in the README and in ``docs/benchmarks.md`` are what ``benchmarks/results/`` gives
  (``python -m benchmarks.render --write`` updates them).
- Every name of ``rollout_sync.__all__`` resolves, and the README's code imports rollout-sync only from the
  package's top level (the public API).
- The examples are users' own programs: they import rollout-sync only from its top level (and the tiny-model
  maker, ``rollout_sync.tiny``), nothing of the checkout (``testbed``, ``tests``, ``benchmarks``), and do
  not put the checkout on ``sys.path``; their tests run them from outside the checkout.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import rollout_sync
from benchmarks import render
from benchmarks.records import cpu_kind, last_json, load_records

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_is_a_front_page_of_at_most_250_lines() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_every_relative_link_of_the_readme_names_a_file_that_exists() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links its docs pages"
    assert [link for link in relative if not (ROOT / link).exists()] == []


def test_the_results_tables_are_what_the_records_give() -> None:
    records = load_records()
    for path in (README, ROOT / "docs" / "benchmarks.md"):
        text = path.read_text()
        assert render.BLOCK.search(text), f"{path.name} has no results table"
        assert render.replace_tables(text, records) == text, (
            f"{path.name}: stale results table (python -m benchmarks.render --write README.md docs/benchmarks.md)"
        )


def test_every_record_names_its_machine_commit_date_and_figures() -> None:
    records = load_records()
    assert records
    for stem, record in records.items():
        assert set(record) >= {"bench", "command", "date", "commit", "machine", "figures"}, stem
        assert record["machine"]["cpu"] in render.CPUS, stem
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]), stem
        assert stem.startswith(record["bench"]), stem


def test_a_new_record_is_headline_and_its_rows_render(tmp_path: Path) -> None:
    row = {"trainer": "zero3", "ours_s": 0.5, "baseline_s": 2.0, "bitwise_equal": True}
    record = {
        "bench": "sync",
        "command": "python -m benchmarks sync --json",
        "date": "2030-01-02",
        "commit": "abc1234",
        "machine": {"cpu": "avx2", "flags": ["avx2"], "cores": 2, "described": ""},
        "note": "",
        "figures": {"rows": [row]},
    }
    (tmp_path / "sync-avx2-2030-01-02.json").write_text(json.dumps(record))
    older = {**record, "date": "2029-01-01", "figures": {"rows": [{**row, "ours_s": 9.0}]}}
    (tmp_path / "sync-avx2-2029-01-01.json").write_text(json.dumps(older))
    variant = {**record, "figures": {"rows": [{**row, "ours_s": 7.0}]}}
    (tmp_path / "sync-avx2-2030-01-02-delta.json").write_text(json.dumps(variant))
    table = render.table(load_records(tmp_path))
    assert "| **0.5 s** | 2 s | 4.0× | yes | `sync-avx2-2030-01-02` |" in table
    assert "9 s" not in table and "7 s" not in table


def test_the_machine_kind_and_the_last_printed_json() -> None:
    assert cpu_kind(["avx2", "avx512f", "amx_tile"]) == "amx"
    assert cpu_kind(["avx2", "avx512f"]) == "avx512"
    assert cpu_kind(["avx2"]) == "avx2"
    assert last_json('log\n{"rows": [1]}\n[x] done\n') == {"rows": [1]}
    assert last_json("no json here\n") is None


@pytest.mark.parametrize("name", rollout_sync.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(rollout_sync, name) is not None


def test_the_readme_imports_rollout_sync_only_from_its_top_level() -> None:
    code = "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(), re.S))
    imported = re.findall(r"^\s*from (rollout_sync[\w.]*|vllm_plugin[\w.]*) import (.+)$", code, re.M)
    assert imported, "the README shows how to import rollout-sync"
    assert {module for module, _ in imported} == {"rollout_sync"}
    names = {n.strip() for _, names in imported for n in names.split(",")}
    assert names <= set(rollout_sync.__all__), names - set(rollout_sync.__all__)


def test_every_path_the_docs_name_in_the_checkout_exists() -> None:
    """A file or folder of this checkout named in code font in the README or a docs page exists (a module
    moved without its docs fails here; mkdocs checks only the pages' links)."""
    tops = ("rollout_sync/", "vllm_plugin/", "benchmarks/", "tests/", "testbed/", "examples/", "scripts/")
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = {
        f"{page.name}: {path}"
        for page in pages
        for path in re.findall(r"`([\w./-]+)`", page.read_text())
        if path.startswith(tops) and "*" not in path and not (ROOT / path.rstrip("/")).exists()
    }
    assert missing == set()


def _checkout_bound(path: Path) -> list[str]:
    """What in example ``path`` needs the checkout or goes past the public API."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        else:
            if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node) == "sys.path":
                found.append(f"line {node.lineno}: sys.path")
            continue
        for module, names in modules:
            top = module.split(".")[0]
            if module == "rollout_sync":
                found += [
                    f"line {node.lineno}: rollout_sync.{n}" for n in names if n not in rollout_sync.__all__
                ]
            elif (
                top in ("rollout_sync", "vllm_plugin", "testbed", "tests", "benchmarks")
                and module != "rollout_sync.tiny"
            ):
                found.append(f"line {node.lineno}: {module}")
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.py")), ids=lambda p: p.name)
def test_an_example_imports_only_the_installed_public_api(path: Path) -> None:
    assert _checkout_bound(path) == [], path.relative_to(ROOT)
