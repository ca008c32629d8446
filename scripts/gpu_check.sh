#!/usr/bin/env bash
# The GPU check (issue 17): four processes on one GPU move a Qwen3-0.6B-shaped model (about 1.5 GB of bf16,
# ZeRO-3 flat partitions to vLLM TP-2 shards) through the CUDA-IPC same-host transport with the real
# executor, check it bit for bit, and print its bandwidth beside a device-to-device copy of the same bytes
# measured in the same run (python -m benchmarks ipc). Needs only python3 with torch (CUDA) and
# numpy: no vLLM, DeepSpeed, pyzmq or network. Ends within 5 minutes (each step has its own timeout).
# Usage: bash scripts/gpu_check.sh [extra arguments of `bench ipc`]
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
echo "== gpu_check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
timeout 45 "$PY" - <<'PY' || { echo "gpu_check: no usable CUDA torch"; exit 2; }
import numpy, torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), numpy {numpy.__version__}")
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("device 0:", torch.cuda.get_device_name(0))
from rollout_sync.transport import cuda_ipc
t = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
words, offset, nbytes = cuda_ipc.export(t[5:])
print(f"cuda_ipc.export: handle of {len(words)} words, storage at byte {offset} of its block, {nbytes} bytes")
PY
tests=0
# pytest is pure Python: where the lent machine has none, a session carries the local one
# (`bash scripts/gpu_deps.sh`, then the device tool's run with carry [".gpu_deps"]).
if ! "$PY" -c "import pytest" 2>/dev/null && [ -d .gpu_deps ]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_deps"
  echo "pytest from .gpu_deps (the machine has none)"
fi
echo "== tests/gpu (the delta codec on the device, IPC handles, a small IPC sync, a sender killed with SIGKILL)"
timeout 110 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/gpu 2>&1 | tail -25 || tests=$?
status=0
echo "== bench ipc: Qwen3-0.6B shapes, ZeRO-3 on ranks 0-1 to TP 2 on ranks 2-3, all on GPU 0"
timeout 140 "$PY" -m benchmarks ipc --device cuda --timeout 130 --json "$@" || status=$?
echo "== gpu_check: tests/gpu exit status $tests, bench ipc exit status $status (0: verified bit for bit, every pair mapped, nothing left in /dev/shm)"
[ "$tests" = 0 ] && [ "$status" = 0 ]
