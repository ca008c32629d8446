"""The rollout program: a vLLM engine that receives every sync from a DeepSpeed job in another program.

    export ROLLOUT_SYNC_TOKEN=...            # the same token as the trainer program
    python examples/two_programs/rollout.py --model /tmp/tiny-dense --address tcp://127.0.0.1:29700 \\
        --trainer-ranks 2 --steps 2 --verify-dir /tmp/verify

It starts ``LLM(...)`` with rollout-sync's worker extension, probes vLLM's own loaders for the target maps,
connects its workers to the trainer's coordinator (either program may start first; each waits up to
``--join-deadline`` for the other), then for each of ``--steps`` syncs: receives the weights in place, sets vLLM's
``weight_version`` and generates greedily. With ``--verify-dir`` it then writes the trainer's own checkpoint
of that version into vLLM through vLLM's loader maps and checks that no parameter changes (bit for bit), as
``examples/grpo.py --verify`` does. The last line is a JSON summary; the exit status is 0 when every sync
was received (and verified).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = ([5, 6, 7, 8, 9], [100, 200, 300])


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the same checkpoint the trainer starts from")
    ap.add_argument("--address", required=True, help="the trainer's coordinator, tcp://HOST:PORT")
    ap.add_argument("--trainer-ranks", type=int, default=2, help="the trainer job's world size")
    ap.add_argument("--engine", type=int, default=0, help="this engine's index among the trainer's --engines")
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor-parallel size")
    ap.add_argument("--steps", type=int, default=2, help="how many syncs to receive")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any wait of a sync may take")
    ap.add_argument(
        "--join-deadline", type=float, default=600.0, help="seconds to keep waiting for the trainer program"
    )
    ap.add_argument(
        "--atomic",
        action="store_true",
        help="a sync lands whole or not at all: a failed one leaves the old weights (a copy is held per sync)",
    )
    ap.add_argument("--verify-dir", default=None, help="where the trainer writes its weights per version")
    return ap.parse_args(argv)


def engine_env(tp: int) -> None:
    """vLLM on CPU: one core set per TP rank (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``)."""
    cores = sorted(os.sched_getaffinity(0))
    if tp > 1:
        per = max(len(cores) // tp, 1)
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(",".join(str(c) for c in cores[i * per : (i + 1) * per]) for i in range(tp)),
        )


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer did not write {path} within {timeout:g} s")
        time.sleep(0.1)


def verify(llm: Any, verify_dir: Path, version: int, timeout: float) -> int:
    """Write the trainer's checkpoint of ``version`` into vLLM through vLLM's own loader maps; return how
    many parameters that changed (0: vLLM held exactly the trainer's weights)."""
    from rollout_sync import verify_engine

    wait_for(verify_dir / f"v{version}.done", timeout)
    return len(verify_engine(llm, str(verify_dir / f"v{version}")))


def weights_digest(llm: Any) -> str:
    """One digest of every parameter of every worker (to tell that the weights moved)."""
    import hashlib

    per_worker = llm.collective_rpc("rollout_sync_param_digests")
    return hashlib.sha256(json.dumps(per_worker, sort_keys=True).encode()).hexdigest()[:16]


def connect(llm: Any, args: argparse.Namespace, token: str | None) -> None:
    """Join a handshake with the trainer program, waiting for it up to ``--join-deadline`` (a handshake that
    times out is joined again: the trainer may still be starting, or failing a sync, or a link down)."""
    from rollout_sync import PeerFailedError, connect_engine

    deadline = time.monotonic() + args.join_deadline
    while True:
        try:
            connect_engine(
                llm, args.address, args.engine, token=token, timeout=args.timeout, atomic=args.atomic
            )
            return
        except PeerFailedError as exc:
            if "SyncTimeoutError" not in str(exc) or time.monotonic() > deadline:
                raise


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    engine_env(args.tp)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout_sync import RolloutSyncError, receive_sync, setup_engines

    token = os.environ.get("ROLLOUT_SYNC_TOKEN")  # None: each worker reads it (and names it when missing)
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=64 * 2**20,
        seed=0,
        worker_extension_cls="vllm_plugin.extension.RolloutSyncExtension",
    )
    print(f"[rollout] vLLM engine up in {time.perf_counter() - started:.0f} s", flush=True)
    setup_engines([llm], first_rank=args.trainer_ranks + args.engine * args.tp)
    started = time.perf_counter()
    connect(llm, args, token)
    print(f"[rollout] joined the trainer's sync group in {time.perf_counter() - started:.1f} s", flush=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    initial = weights_digest(llm)
    rows: list[dict[str, Any]] = []
    for _ in range(args.steps):
        before = weights_digest(llm)
        try:
            reports = receive_sync([llm])[0]  # blocks until the trainer ranks have sent this sync
        except RolloutSyncError as exc:  # nothing claimed; with --atomic, no weight changed either
            after = weights_digest(llm)
            rows.append({"error": f"{type(exc).__name__}: {exc}", "weights_kept": after == before})
            print(
                f"[rollout] the sync failed ({type(exc).__name__}); weights kept: {after == before}",
                flush=True,
            )
            connect(llm, args, token)  # a new handshake, the same engine
            continue
        version = int(reports[0]["version"])
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], greedy, use_tqdm=False)
        row: dict[str, Any] = {
            "version": version,
            "weight_version": llm.get_weight_version(),
            # as messages over the sync group (group-free, backend nixl: read from the trainer's registered
            # storages), or copied from the trainer's storages this worker maps or pulls (same host only)
            "bytes_over_group": sum(sum(r["stats"]["bytes_received"].values()) for r in reports),
            "bytes_same_host": sum(
                sum(r["stats"]["bytes_mapped_from"].values()) + sum(r["stats"]["bytes_pulled"].values())
                for r in reports
            ),
            # layers vLLM keeps in another form (CPU GEMM prepacks on AVX-512 and AMX CPUs): written in
            # their loaded form and rebuilt by vLLM; None where every layer keeps its plain weight
            "layers_rebuilt": None
            if all(r["loaded_forms"] is None for r in reports)
            else sum(r["loaded_forms"]["rebuilt"] for r in reports if r["loaded_forms"] is not None),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "weights_digest": weights_digest(llm),
        }
        if args.verify_dir:
            changed = verify(llm, Path(args.verify_dir), version, args.timeout)
            row["params_differing"] = changed
            row["verified"] = changed == 0
        row["bytes_received"] = row["bytes_over_group"] + row["bytes_same_host"]
        rows.append(row)
        print(
            f"[rollout] received v{version} ({row['bytes_received'] / 1e6:.2f} MB), greedy {row['tokens'][0]}"
            + (
                f", vLLM == trainer bit for bit: {'yes' if row['verified'] else 'NO'}"
                if args.verify_dir
                else ""
            ),
            flush=True,
        )
    ok = any("error" not in r for r in rows) and all(
        "error" in r or (r.get("verified", True) and r["weight_version"] == str(r["version"])) for r in rows
    )
    print(json.dumps({"rollout": rows, "initial_weights_digest": initial, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
