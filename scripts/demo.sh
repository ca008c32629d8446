#!/usr/bin/env bash
# The main job: sets up the environment if needed (scripts/setup.sh, idempotent), then runs the GRPO
# example end to end on CPU: a tiny Qwen3 made locally, DeepSpeed ZeRO-3 on 2 trainer ranks, one vLLM
# engine at TP 2, a sync after every optimizer step, each verified bit for bit. Extra arguments go to the
# example (e.g. `bash scripts/demo.sh --zero 2`, `--autoep 2`, `--steps 8`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export DS_ACCELERATOR=cpu
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python examples/grpo.py --verify "$@"
