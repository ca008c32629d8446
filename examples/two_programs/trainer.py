"""The trainer program: a DeepSpeed job that syncs its weights into a vLLM engine in another program.

Run it under a launcher that starts one process per rank and sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` (``torchrun``, or ``deepspeed`` on a machine with accelerators)::

    export ROLLOUT_SYNC_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')
    python -m torch.distributed.run --nproc-per-node 2 examples/two_programs/trainer.py \\
        --model /tmp/tiny-dense --address tcp://127.0.0.1:29700 --steps 2 --verify-dir /tmp/verify

Every rank builds its DeepSpeed engine (ZeRO-3 by default) and attaches rollout-sync: trainer rank 0 runs
the coordinator on ``--address``, and ``attach`` returns once the rollout program's workers have joined.
Each optimizer step then syncs (inside ``engine.step()``). The training step here is a language-model step
on random tokens: the point is the weight movement, the loss is a stand-in for an RL objective.

With ``--verify-dir``, after each sync the trainer's weights, gathered by DeepSpeed itself (not through
rollout-sync's maps), are written as a checkpoint ``v{version}/`` and marked done (``v{version}.done``); the
rollout program writes that checkpoint into vLLM and checks that no bit changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (python -m rollout_sync.tiny)")
    ap.add_argument("--address", required=True, help="the coordinator's address, tcp://HOST:PORT")
    ap.add_argument("--engines", type=int, default=1, help="how many vLLM engines take part")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any wait of a sync may take")
    ap.add_argument(
        "--join-deadline", type=float, default=600.0, help="seconds to keep waiting for the rollout program"
    )
    ap.add_argument("--verify-dir", default=None, help="write the trainer's weights here after each sync")
    ap.add_argument(
        "--gate",
        default=None,
        help="a directory: step k starts once the file go-k is there (a test or a demo drives the steps; "
        "engines may join or leave between them); without it the steps run back to back",
    )
    ap.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nixl"),
        help="gloo: one process group with the engines; nixl: no group, each vLLM worker reads its half "
        "from this job's registered storages (pip install 'rollout-sync[nixl]')",
    )
    return ap.parse_args(argv)


def init_distributed() -> None:
    """DeepSpeed's process group over gloo, from the launcher's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``. On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory op when it starts (about a
    minute, the first time on a machine) that serves only inference all-reduce; training goes through gloo
    either way, so the build is skipped, as DeepSpeed itself does where the op is not compatible."""
    import importlib

    import deepspeed

    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def build_engine(model: str, zero: int, lr: float) -> Any:
    """The checkpoint in bf16 under DeepSpeed at ZeRO stage ``zero``. On CPU the optimizer is torch's AdamW
    (``torch_adam``): DeepSpeed's own AdamW would JIT-compile FusedAdam first."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": zero},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    return engine


def train_step(engine: Any, seed: int) -> float:
    """One language-model step on random tokens (the same on every rank); ``engine.step()`` syncs."""
    import torch

    vocab = engine.module.config.vocab_size
    tokens = torch.randint(4, vocab, (1, 16), generator=torch.Generator().manual_seed(seed))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float().item())


def write_verification(sync: Any, rank: int, model: str, out: Path, version: int) -> None:
    """The weights as DeepSpeed gathers them (collective), saved by rank 0, then the done marker."""
    sync.save_reference(model, str(out / f"v{version}"))
    if rank == 0:
        (out / f"v{version}.done").write_text(str(version))


def attach(engine: Any, args: argparse.Namespace) -> Any:
    """Join a handshake with the rollout program, waiting for it up to ``--join-deadline`` (a handshake
    that times out is joined again: the other program may still be starting, or a link still down)."""
    from rollout_sync import SyncTimeoutError, TrainerSync

    deadline = time.monotonic() + args.join_deadline
    while True:
        try:
            return TrainerSync.attach(
                engine, address=args.address, engines=args.engines, timeout=args.timeout, backend=args.backend
            )
        except SyncTimeoutError:
            if time.monotonic() > deadline:
                raise


def wait_for_gate(gate: Path, step: int, timeout: float) -> None:
    """Every rank waits for ``gate/go-{step}`` (bounded: a driver that never opens it fails the program)."""
    deadline = time.monotonic() + timeout
    while not (gate / f"go-{step}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step}: {gate / f'go-{step}'} did not appear within {timeout:g} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    from rollout_sync import RolloutSyncError

    torch.set_num_threads(1)
    init_distributed()
    rank = dist.get_rank()
    engine = build_engine(args.model, args.zero, args.lr)
    started = time.perf_counter()
    sync = attach(engine, args)
    joined_s = time.perf_counter() - started
    if rank == 0:
        print(f"[trainer] rollout program joined; plan ready after {joined_s:.1f} s", flush=True)
    out = Path(args.verify_dir) if args.verify_dir else None
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = []
    for step in range(1, args.steps + 1):
        synced = len(sync.history)
        if args.gate:
            wait_for_gate(Path(args.gate), step, args.join_deadline)
        try:
            loss = train_step(engine, seed=step)  # engine.step() inside syncs (the hook)
        except RolloutSyncError as exc:  # the step applied, its sync failed: on every rank
            steps.append({"step": step, "error": f"{type(exc).__name__}: {exc}"})
            if rank == 0:
                print(
                    f"[trainer] step {step}: the sync failed ({type(exc).__name__}); joining again",
                    flush=True,
                )
            sync.detach()
            sync = attach(engine, args)  # the same processes; the next step syncs into the engines again
            continue
        last = sync.last
        if last is None or len(sync.history) != synced + 1:
            raise RuntimeError(f"step {step} did not sync (history {len(sync.history)})")
        if out is not None:
            write_verification(sync, rank, args.model, out, last.version)
        # group-free (nixl): the workers this sync dropped, whole engines, each named with why
        dropped = list(last.dropped)
        steps.append({"step": step, "loss": loss, "version": last.version, "sync_s": last.seconds, "dropped": dropped})  # fmt: skip
        if rank == 0:
            print(
                f"[trainer] step {step}: loss {loss:.4f}, synced v{last.version} in {last.seconds * 1000:.0f} ms"
                + (f"; dropped: {'; '.join(dropped)}" if dropped else ""),
                flush=True,
            )
    sync.detach()
    if rank == 0:
        print(json.dumps({"trainer": steps}), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
