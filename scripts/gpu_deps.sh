#!/usr/bin/env bash
# Copy the pure-Python packages scripts/gpu_check.sh needs beyond torch and numpy (pytest and what it
# imports) from this checkout's .venv into .gpu_deps/ (ignored by git, about 2.3 MB), for a lent GPU machine
# that has no pytest and no network: pass carry [".gpu_deps"] to the device tool's run.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf .gpu_deps && mkdir -p .gpu_deps
for pkg in pytest _pytest pluggy iniconfig packaging; do
  cp -r "$site/$pkg" .gpu_deps/
done
find .gpu_deps -name __pycache__ -prune -exec rm -rf {} +
du -sh .gpu_deps
