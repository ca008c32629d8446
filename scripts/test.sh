#!/usr/bin/env bash
# The project's test command: sets up the environment if needed (scripts/setup.sh, idempotent), then runs
# the linters, the type checker, the docs build (MkDocs, strict) and the test suite (all tests but those marked gpu) on two pytest-xdist
# workers (ROLLOUT_SYNC_TEST_WORKERS; 0 runs in this process; tests/conftest.py groups the tests). Extra
# arguments go to pytest, e.g. `bash scripts/test.sh -m "not vllm" -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
py=".venv/bin/python"
export DS_ACCELERATOR=cpu
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
echo "[test] ruff" >&2
"$py" -m ruff check rollout_sync vllm_plugin tests examples benchmarks
"$py" -m ruff format --check rollout_sync vllm_plugin tests examples benchmarks
echo "[test] mypy" >&2
"$py" -m mypy
echo "[test] docs" >&2
site="$(mktemp -d)"
# A broken link, anchor or page fails here (not --quiet: it hides the warnings that strict mode counts).
if ! built="$("$py" -m mkdocs build --strict --site-dir "$site" 2>&1)"; then
  echo "$built" >&2
  rm -rf "$site"
  exit 1
fi
rm -rf "$site"
echo "[test] pytest" >&2
workers="${ROLLOUT_SYNC_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)
fi
"$py" -m pytest "${parallel[@]}" --durations=25 "$@"  # the 25 slowest tests are listed at the end
