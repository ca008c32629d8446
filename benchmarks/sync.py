"""Whole-sync benchmark with real engines: ours against today's practice, in one run, on the same weights.

``python -m benchmarks sync [--json] [--workdir DIR] [--syncs 3] [--warmup 1] [--rows zero3,zero2]
[--stand-in-packing]``

Model: Qwen3-0.6B's shapes with random bf16 weights (``testbed.shaped_models``). Trainer:
DeepSpeed over 2 CPU ranks (``zero3``: ZeRO-3; ``zero2``: ZeRO-2, 2 replicas, balanced policy; SGD, never
stepped). Rollout: one vLLM CPU engine at TP 2 with ``testbed.baseline_extension.BenchExtension``. One row at a
time: each row builds its trainer and its engine and tears both down before the next.

Packed layers: where the CPU makes vLLM pack its dense linear weights (AVX-512/AMX: an empty weight, a
kernel's packed copy), ours writes each layer's loaded form and vLLM rebuilds the packed form layer by layer;
the baseline wraps its loads in vLLM's ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``.
``--stand-in-packing`` packs them with ``testbed.packing`` on a CPU where vLLM keeps plain
weights, so the same paths run there (the row says which: ``packing``).

Before every sync the trainer's weights are negated in place (bf16 and fp32 copies alike, exact), so each
sync moves new values.

- ``ours``: the handshake once (``TrainerSync.attach`` / ``rollout_sync_connect``, ``shared_memory=False``:
  every byte over gloo), then each sync = executing the plan (trainer ranks send their half, workers
  receive theirs and refresh vLLM's derived copies), then ``reset_prefix_cache``.
- ``ours_same_host``: the same after a second handshake with the same-host transport (the default:
  trainer ranks and workers share this host, so each worker maps the trainer ranks' storages and copies
  straight from them, ``transport.mapped``); its own bitwise check (``same_host_bitwise_equal``).
- ``delta``: a third handshake with ``delta=True`` (over gloo, like ``ours``). Per changed fraction (1%, 10%,
  50%): two full syncs (unmeasured: they fill the trainer ranks' shadows), then ``--warmup`` + ``--syncs``
  syncs, each after a synthetic optimizer step on that fraction of the trainer's stored weights at random
  positions (``change``: ``w·(1 + ε)``, ε ~ N(0, 0.01²), in bf16, every chosen element changed): delta
  syncs, or full ones where the senders' samples show more than ``delta_full_above`` (1/32) changed; then
  the bitwise check. ``full_s`` is ``ours_s`` (the full sync over gloo in the same run).
- ``baseline`` (OpenRLHF style): a gloo group of trainer rank 0 and every vLLM worker; per parameter,
  ``GatheredParameters`` on every trainer rank, rank 0 broadcasts the full tensor, each worker receives it
  into a fresh buffer and calls ``model.load_weights``; at the end derived copies are rebuilt as ours does,
  then ``reset_prefix_cache``.

A sync's time is the driver's wall time from starting the trainer command to the cache reset. Each method
runs ``--warmup`` unmeasured syncs, then ``--syncs`` measured ones; medians are reported. Peak extra memory is
the kernel's RSS high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the RSS just
before the sync, in every trainer rank and every vLLM worker; the row reports the largest per side, over the
measured syncs. After each method's last sync the trainer's gathered weights are saved as a checkpoint and
written into the engine through vLLM's loader maps (``apply_checkpoint``): if no worker's parameter digest
changes, the engine held exactly the trainer's weights (``bitwise_equal``). Packed layers hold empty weights:
for ours, one more (unmeasured) sync digests every layer's loaded form before vLLM rebuilds it, and the
checkpoint's write must give the same digests; the baseline's loaded forms cannot be seen (vLLM's reload
consumes them), so its ``baseline_bitwise_equal`` covers the unpacked parameters only. After the row, a fresh engine is started from the
checkpoint saved after ours (packed the same way) and its raw logits for every vocabulary entry at two
greedy positions of a fixed prompt are compared, by digest, with the synced engine's (``logits_equal``).

Last line with ``--json``: ``{"rows": [{"trainer", "ours_s", "baseline_s", "ours_trainer_extra_bytes",
"baseline_trainer_extra_bytes", "ours_rollout_extra_bytes", "baseline_rollout_extra_bytes",
"ours_bytes_moved", "baseline_bytes_moved", "bitwise_equal", "packed_layers", "logits_equal",
"staging_cap_bytes", "ours_staging_bytes", "largest_layer_loaded_bytes", "ours_same_host_s",
"ours_same_host_trainer_extra_bytes", "ours_same_host_rollout_extra_bytes", "ours_same_host_staging_bytes",
"same_host_bitwise_equal", "delta_rows": [{"changed_fraction", "ours_delta_s", "delta_bytes_moved",
"bitwise_equal"}], "delta_state_bytes", "full_s", ...}]}`` (``delta_bytes_moved``: what the trainer ranks
sent in one delta sync, heads included; ``delta_state_bytes``: the largest trainer rank's shadow). Ours' extra-memory figures include the staging each rank holds across
syncs (``ours_staging_bytes``: the largest, on either side; on a worker that writes loaded forms, with the
pool of buffers they are written into), not only what a measured sync newly touched. Per measured sync:
``*_all_s`` (seconds) and ``*_rollout_extra_all_bytes`` (the largest worker's extra bytes);
``ours_rollout_phase_s``: the slowest worker's receive by phase in the last measured sync.

Measured (2026-11-30, 2 cores, load 3-6, 1 warm-up and 3 measured syncs per method): zero3 ours 0.533 s
against 4.304 s (8.07x), trainer extra 12 KB against 622 MB, worker extra 8 KB against 311 MB, 1.19 GB moved
against 2.38 GB; zero2 ours 0.531 s against 2.369 s (4.46x), trainer extra 4 KB against 0.68 MB; bitwise
equal for both methods on both rows. The engine's loader probe took 42 s at these shapes, with the whole
machine at 7 GB used during it (before the probe kept one integer per element of a window, a TP-2 worker was
OOM-killed past 10 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from testbed.peak_memory import PeakMemory
from testbed.rank_pool import RankContext

__all__ = ["assemble_row", "main", "method_summary"]

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_KIND = "qwen3-0.6b-shapes"
EXTENSION = "testbed.baseline_extension.BenchExtension"
TOKEN = "bench-sync"
TRAINERS = 2
TP = 2
TRAINER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
BUCKETS = {"reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
ROWS = ("zero3", "zero2")


# ------------------------------------------------------------------------------------------ pure helpers


def method_summary(
    seconds: Sequence[float],
    trainer: Sequence[Sequence[Mapping[str, Any]]],
    workers: Sequence[Sequence[Mapping[str, Any]]],
) -> dict[str, Any]:
    """One method's figures over its measured syncs: median seconds, largest extra bytes per side, bytes
    the trainer ranks sent per sync (the same at every sync; the largest is reported).

    A rank's extra bytes are its RSS high-water mark during the sync above the RSS before it, **plus the
    staging it holds across syncs** (``peak_staging_bytes``: the arena allocated at the first sync and
    reused, and shared-memory slots): those were allocated in the warm-up sync, so the measured syncs'
    high-water mark does not see them, but they are memory the method keeps. ``*_staging_bytes``: the
    largest staging per side alone."""
    if not seconds or len(seconds) != len(trainer) or len(seconds) != len(workers):
        raise ValueError(
            f"expected one trainer and one worker report per measured sync, found {len(seconds)} times, "
            f"{len(trainer)} trainer and {len(workers)} worker reports"
        )
    return {
        "seconds": statistics.median(seconds),
        "all_seconds": [round(s, 4) for s in seconds],
        "trainer_extra_bytes": max(int(r["extra_bytes"]) + _staging(r) for sync in trainer for r in sync),
        "rollout_extra_bytes": max(int(r["extra_bytes"]) + _staging(r) for sync in workers for r in sync),
        "rollout_extra_all_bytes": [
            max(int(r["extra_bytes"]) + _staging(r) for r in sync) for sync in workers
        ],
        "trainer_staging_bytes": max(_staging(r) for sync in trainer for r in sync),
        "rollout_staging_bytes": max(_staging(r) for sync in workers for r in sync),
        "bytes_moved": max(sum(int(r["bytes_sent"]) for r in sync) for sync in trainer),
        "rollout_phase_s": _phases(workers[-1]),
    }


def _staging(report: Mapping[str, Any]) -> int:
    """The staging a rank holds across syncs, from its sync report (0 for the baseline, which has none),
    with, on a worker that writes loaded forms, the buffers they are written into (kept between syncs)."""
    if "peak_staging_bytes" in report:
        return int(report["peak_staging_bytes"])
    pool = int((report.get("loaded_forms") or {}).get("pool_bytes", 0))
    return int((report.get("stats") or {}).get("peak_staging_bytes", 0)) + pool


def _phases(reports: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Seconds by phase of the slowest worker's receive (the executor's phases, and the loaded forms'
    opening and rebuilding where the engine keeps layers in another form), from one sync's reports."""
    out: dict[str, float] = {}
    for r in reports:
        phases = dict((r.get("stats") or {}).get("seconds") or {})
        forms = r.get("loaded_forms") or {}
        phases.update({k: v for k, v in forms.items() if k.endswith("_s")})
        for k, v in phases.items():
            out[k] = max(out.get(k, 0.0), round(float(v), 4))
    return out


def assemble_row(
    trainer: str,
    ours: Mapping[str, Any],
    baseline: Mapping[str, Any],
    *,
    ours_equal: bool,
    baseline_equal: bool,
    staging_cap_bytes: int,
) -> dict[str, Any]:
    row: dict[str, Any] = {"trainer": trainer}
    for name, m in (("ours", ours), ("baseline", baseline)):
        row[f"{name}_s"] = round(float(m["seconds"]), 4)
        row[f"{name}_trainer_extra_bytes"] = int(m["trainer_extra_bytes"])
        row[f"{name}_rollout_extra_bytes"] = int(m["rollout_extra_bytes"])
        row[f"{name}_bytes_moved"] = int(m["bytes_moved"])
        row[f"{name}_all_s"] = list(m["all_seconds"])
        if "rollout_extra_all_bytes" in m:  # per measured sync, the largest worker's
            row[f"{name}_rollout_extra_all_bytes"] = list(m["rollout_extra_all_bytes"])
        if m.get("rollout_phase_s"):
            row[f"{name}_rollout_phase_s"] = dict(m["rollout_phase_s"])
    row["bitwise_equal"] = bool(ours_equal)
    row["baseline_bitwise_equal"] = bool(baseline_equal)
    row["speedup"] = round(row["baseline_s"] / row["ours_s"], 2) if row["ours_s"] > 0 else None
    row["ours_staging_bytes"] = max(
        int(ours.get("trainer_staging_bytes", 0)), int(ours.get("rollout_staging_bytes", 0))
    )
    row["staging_cap_bytes"] = int(staging_cap_bytes)
    return row


# ------------------------------------------------------------------------------------ trainer commands


def _engine(ctx: RankContext) -> Any:
    return ctx.state["engine"]


def perturb(ctx: RankContext) -> None:
    """Negate every weight this rank stores, low-precision and fp32 copies alike (exact, no memory)."""
    import torch

    engine = _engine(ctx)
    with torch.no_grad():
        for p in engine.module.parameters():
            (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).neg_()
        opt = engine.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for t in getattr(opt, attr, None) or []:
                t.data.neg_()


def change(ctx: RankContext, fraction: float, seed: int) -> int:
    """A synthetic optimizer step on ``fraction`` of the weights this rank stores, at random positions: each
    chosen bf16 element becomes ``w·(1 + ε)``, ε ~ N(0, 0.01²), rounded to bf16, or moves by one unit in the
    last place where that rounding gives ``w`` back, so every chosen element changes, by a step of the size
    an optimizer takes. Replicas (ZeRO-0/1/2: every rank holds every parameter) change alike (the positions
    and steps come from the parameter's name and ``seed``). Returns the elements changed on this rank."""
    import zlib

    import torch

    engine = _engine(ctx)
    changed = 0
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            data = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
            flat = data.view(-1)
            key = zlib.crc32(name.encode()) + 7919 * seed + (ctx.rank if hasattr(p, "ds_tensor") else 0)
            g = torch.Generator().manual_seed(key)
            n = round(fraction * flat.numel())
            at = torch.randperm(flat.numel(), generator=g)[:n]
            old = flat[at]
            new = (old.float() * (1 + 0.01 * torch.randn(n, generator=g))).to(flat.dtype)
            bits, old_bits = new.view(torch.int16), old.view(torch.int16)
            same = bits == old_bits
            bits[same] = old_bits[same] + 1
            flat[at] = new
            changed += n
    return changed


def ours_sync(ctx: RankContext, version: int) -> dict[str, Any]:
    memory = PeakMemory().start()
    result = ctx.state["sync"].sync(version)
    extra = memory.stop()
    stats = result.stats.to_dict()
    return {
        "rank": ctx.rank,
        "seconds": result.seconds,
        "extra_bytes": extra,
        "bytes_sent": sum(int(v) for v in stats["bytes_sent"].values()),
        "peak_staging_bytes": stats["peak_staging_bytes"],
        "memory_method": memory.method,
        "delta_base": stats["delta_base"],
        "elements_compared": stats["elements_compared"],
        "elements_changed": stats["elements_changed"],
        "delta_state_bytes": stats["delta_state_bytes"],
        "estimated_changed_share": stats["estimated_changed_share"],
        "phase_seconds": stats["seconds"],
    }


def detach(ctx: RankContext) -> None:
    """Leave the sync group (its shared segments released) before the next handshake."""
    ctx.state.pop("sync").detach()


def param_specs(ctx: RankContext) -> list[tuple[str, list[int], str]]:
    out = []
    for name, p in _engine(ctx).module.named_parameters():
        shape = list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape)
        out.append((name, shape, str(p.dtype).removeprefix("torch.")))
    return out


def baseline_connect(ctx: RankContext, host: str, port: int, world_size: int, timeout: float) -> int:
    from rollout_sync.transport.core.groups import connect_store, new_group

    if ctx.rank == 0:
        store = connect_store(host, port, world_size, is_master=True, timeout=timeout)
        ctx.state["baseline_group"] = new_group(
            store, 0, world_size, timeout=timeout, prefix="rollout-sync-baseline"
        )
    return ctx.rank


def baseline_sync(ctx: RankContext) -> dict[str, Any]:
    """Per parameter: gather it (every rank), rank 0 broadcasts the full tensor to every vLLM worker."""
    import deepspeed
    import torch
    import torch.distributed as dist

    engine = _engine(ctx)
    group = ctx.state.get("baseline_group")
    receivers = group.size() - 1 if group is not None else 0
    memory = PeakMemory().start()
    start = time.perf_counter()
    sent = 0
    with torch.no_grad():
        for _, p in engine.module.named_parameters():
            gather = (
                deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else contextlib.nullcontext()
            )
            with gather:
                if group is not None:
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    group.broadcast([p.data], opts).wait()
                    sent += p.data.numel() * p.data.element_size() * receivers
    return {
        "rank": ctx.rank,
        "seconds": time.perf_counter() - start,
        "extra_bytes": memory.stop(),
        "bytes_sent": sent,
        "memory_method": memory.method,
    }


def save_checkpoint(ctx: RankContext, out: str, model_dir: str) -> int:
    """The trainer's full weights (DeepSpeed's own gathers) as a checkpoint directory; collective."""
    from safetensors.torch import save_file

    from testbed.deepspeed import full_parameters

    full = full_parameters(_engine(ctx))
    if ctx.rank == 0:
        path = Path(out)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        for f in Path(model_dir).iterdir():
            if (
                f.is_file()
                and not f.name.endswith(".safetensors")
                and f.name != "model.safetensors.index.json"
            ):
                shutil.copy(f, path / f.name)
        save_file({n: t.contiguous() for n, t in full.items()}, str(path / "model.safetensors"))
    return len(full)


# ----------------------------------------------------------------------------------------- the engine


def _descendants() -> set[int]:
    import psutil

    pids = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not any(h in " ".join(proc.cmdline()) for h in ("resource_tracker", "forkserver")):
                pids.add(proc.pid)
    return pids


def start_engine(model: Path, **engine_kwargs: Any) -> tuple[Any, set[int]]:
    """A TP-2 vLLM CPU engine of ``model`` with the bench extension; it reports raw logits of every token.
    ``engine_kwargs``: more of ``LLM``'s arguments (``enable_lora``...)."""
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
    }
    os.environ.update(env)
    from vllm import LLM

    before = _descendants()
    llm = LLM(
        model=str(model),
        tensor_parallel_size=TP,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=64 * 2**20,
        seed=0,
        worker_extension_cls=EXTENSION,
        max_logprobs=-1,
        logprobs_mode="raw_logits",
        **engine_kwargs,
    )
    return llm, _descendants() - before


def stop_engine(llm: Any, pids: set[int]) -> list[int]:
    """Shut the engine down; kill (by pid) and return any process it started that outlived it."""
    import psutil

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown(timeout=60)
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=60)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in alive]


# ---------------------------------------------------------------------------------------------- a row


def _log(msg: str) -> None:
    print(f"[bench sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _digests(llm: Any) -> list[dict[str, str]]:
    from vllm_plugin.driver import weight_digests

    return weight_digests(llm)


def _logits(llm: Any) -> str:
    """Digest of the raw logits of every vocabulary entry at two greedy positions of a fixed prompt."""
    import hashlib
    import struct

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=-1)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)[0].outputs[0]
    h = hashlib.sha256(str(list(out.token_ids)).encode())
    for position in out.logprobs or []:
        for token, value in sorted(position.items()):
            h.update(struct.pack("<qd", token, value.logprob))
    return h.hexdigest()


def _pack(llm: Any, stand_in: bool) -> dict[str, int]:
    return dict(llm.collective_rpc("rollout_sync_bench_pack", args=(stand_in,))[0])


def _check_bitwise(pool: Any, llm: Any, out: Path, model: Path, *, keep: bool = False) -> tuple[bool, bool]:
    """(engine held exactly the trainer's weights, the last sync changed the engine's weights)."""
    from vllm_plugin.driver import apply_checkpoint

    pool.call(save_checkpoint, str(out), str(model))
    before = _digests(llm)
    apply_checkpoint([llm], str(out))
    after = _digests(llm)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return before == after, True


def _measure(
    label: str, one_sync: Any, warmup: int, syncs: int, llm: Any, pool: Any
) -> tuple[dict[str, Any], bool]:
    seconds: list[float] = []
    trainer: list[list[dict[str, Any]]] = []
    workers: list[list[dict[str, Any]]] = []
    changed = True
    for i in range(warmup + syncs):
        pool.call(perturb)
        before = _digests(llm) if i == warmup + syncs - 1 else None
        start = time.perf_counter()
        t, w = one_sync(i)
        llm.reset_prefix_cache()
        took = time.perf_counter() - start
        if before is not None:
            changed = before != _digests(llm)
        _log(f"{label} sync {i + 1}/{warmup + syncs}: {took:.2f} s{' (warm-up)' if i < warmup else ''}")
        if i >= warmup:
            seconds.append(took)
            trainer.append(t)
            workers.append(w)
    return method_summary(seconds, trainer, workers), changed


def run_row(
    trainer: str,
    model: Path,
    workdir: Path,
    *,
    warmup: int,
    syncs: int,
    timeout: float,
    staging_cap_bytes: int,
    stand_in: bool = False,
) -> dict[str, Any]:
    from testbed.deepspeed import DeepSpeedSpec
    from testbed.rank_pool import RankPool, free_port
    from testbed.trainer_ranks import attach, setup
    from vllm_plugin.driver import setup_engines

    stage = {"zero3": 3, "zero2": 2}[trainer]
    # SGD is a ZeRO optimizer DeepSpeed calls "untested"; the benchmark never steps it.
    extra: dict[str, Any] = {"zero_allow_untested_optimizer": True}
    if stage == 2:
        extra["zero_optimization"] = dict(BUCKETS)
    spec = DeepSpeedSpec("dense-tied", zero_stage=stage, optimizer="sgd", extra_config=extra)
    with RankPool(TRAINERS, env=TRAINER_ENV, timeout=timeout * 4) as pool:
        # The engine and its setup first (target maps from shapes, checked by tracing the loaders; the
        # element probe only where that cannot follow a loader), before the trainer ranks exist.
        start = time.perf_counter()
        llm, pids = start_engine(model)
        _log(f"{trainer}: vLLM TP-{TP} engine started in {time.perf_counter() - start:.1f} s")
        try:
            packing = _pack(llm, stand_in)
            _log(f"{trainer}: dense linear layers {packing}")
            start = time.perf_counter()
            setup_engines([llm], first_rank=TRAINERS)
            _log(f"{trainer}: target maps in {time.perf_counter() - start:.1f} s")
            summaries = llm.collective_rpc("rollout_sync_summary")
            start = time.perf_counter()
            pool.call(setup, spec, str(model))
            _log(f"{trainer}: DeepSpeed engine built in {time.perf_counter() - start:.1f} s")

            def handshake(shared_memory: bool, delta: bool = False) -> float:
                address = f"tcp://127.0.0.1:{free_port()}"
                start = time.perf_counter()
                pending = pool.submit(
                    attach,
                    address,
                    TOKEN,
                    1,
                    None,
                    "balanced",
                    timeout,
                    staging_cap_bytes,
                    shared_memory,
                    delta,
                )
                llm.collective_rpc(
                    "rollout_sync_connect",
                    kwargs={
                        "address": address,
                        "engine": 0,
                        "token": TOKEN,
                        "timeout": timeout,
                        "staging_cap_bytes": staging_cap_bytes,
                    },
                )
                pending.result(timeout * 2)
                return time.perf_counter() - start

            # ours over gloo first (the figure every row had), the same-host transport after
            handshake_s = handshake(shared_memory=False)
            _log(f"{trainer}: handshake {handshake_s:.2f} s")

            def ours_once(i: int) -> tuple[list[Any], list[Any]]:
                pending = pool.submit(ours_sync, i + 1)
                w = llm.collective_rpc("rollout_sync_bench_receive")
                return pending.result(timeout * 4), w

            ours, ours_changed = _measure(f"{trainer} ours", ours_once, warmup, syncs, llm, pool)
            packed = int(summaries[0]["loaded_form_layers"])
            if packed:  # one more sync, not measured, whose loaded forms are digested before rebuilding
                llm.collective_rpc("rollout_sync_record_loaded", args=(True,))
                pool.call(perturb)
                ours_once(warmup + syncs)
                llm.reset_prefix_cache()
            ours_logits = _logits(llm)
            checkpoint = workdir / f"check-{trainer}-ours"
            ours_equal, _ = _check_bitwise(pool, llm, checkpoint, model, keep=True)
            llm.collective_rpc("rollout_sync_record_loaded", args=(False,))
            _log(f"{trainer} ours: bitwise equal {ours_equal}")

            pool.call(detach)
            handshake(shared_memory=True)
            same_host, same_host_changed = _measure(
                f"{trainer} ours same host", ours_once, warmup, syncs, llm, pool
            )
            same_host_equal, _ = _check_bitwise(pool, llm, workdir / f"check-{trainer}-same-host", model)
            _log(f"{trainer} ours same host: bitwise equal {same_host_equal}")

            pool.call(detach)
            handshake(shared_memory=False, delta=True)
            delta = _measure_delta(trainer, ours_once, warmup, syncs, llm, pool, workdir, model)

            port = free_port()
            world = 1 + TP
            pending = pool.submit(baseline_connect, "127.0.0.1", port, world, timeout)
            llm.collective_rpc("openrlhf_baseline_connect", args=("127.0.0.1", port, world, 1, timeout))
            pending.result(timeout * 2)
            specs = pool.call(param_specs)[0]

            def baseline_once(i: int) -> tuple[list[Any], list[Any]]:
                pending = pool.submit(baseline_sync)
                w = llm.collective_rpc("openrlhf_baseline_receive", args=(specs,))
                return pending.result(timeout * 4), w

            baseline, base_changed = _measure(f"{trainer} baseline", baseline_once, warmup, syncs, llm, pool)
            baseline_equal, _ = _check_bitwise(pool, llm, workdir / f"check-{trainer}-baseline", model)
            _log(f"{trainer} baseline: bitwise equal {baseline_equal}")
        finally:
            leftover = stop_engine(llm, pids)
            if leftover:
                _log(f"{trainer}: killed engine processes that outlived shutdown: {leftover}")
    start = time.perf_counter()
    fresh, pids = start_engine(checkpoint)
    try:
        _pack(fresh, stand_in)
        fresh_logits = _logits(fresh)
    finally:
        stop_engine(fresh, pids)
        shutil.rmtree(checkpoint, ignore_errors=True)
    _log(
        f"{trainer}: fresh engine from the trainer's checkpoint: logits in {time.perf_counter() - start:.1f} s"
    )
    row = assemble_row(
        trainer,
        ours,
        baseline,
        ours_equal=ours_equal and ours_changed,
        baseline_equal=baseline_equal and base_changed,
        staging_cap_bytes=staging_cap_bytes,
    )
    row["ours_same_host_s"] = round(float(same_host["seconds"]), 4)
    row["ours_same_host_all_s"] = list(same_host["all_seconds"])
    row["ours_same_host_trainer_extra_bytes"] = int(same_host["trainer_extra_bytes"])
    row["ours_same_host_rollout_extra_bytes"] = int(same_host["rollout_extra_bytes"])
    row["ours_same_host_rollout_extra_all_bytes"] = list(same_host["rollout_extra_all_bytes"])
    row["ours_same_host_staging_bytes"] = max(
        int(same_host["trainer_staging_bytes"]), int(same_host["rollout_staging_bytes"])
    )
    row["same_host_bitwise_equal"] = bool(same_host_equal and same_host_changed)
    row["handshake_s"] = round(handshake_s, 3)
    row["packed_layers"] = packed
    row["largest_layer_loaded_bytes"] = max(int(s["largest_layer_loaded_bytes"]) for s in summaries)
    row["packing"] = (
        "vllm" if packing["packed_by_vllm"] else "stand-in" if packing["packed_by_stand_in"] else "none"
    )
    row["logits_equal"] = ours_logits == fresh_logits
    row["last_sync_changed_weights"] = {"ours": ours_changed, "baseline": base_changed}
    row["full_s"] = row["ours_s"]
    row.update(delta)
    return row


DELTA_FRACTIONS = (0.01, 0.10, 0.50)


def _measure_delta(
    trainer: str,
    one_sync: Any,
    warmup: int,
    syncs: int,
    llm: Any,
    pool: Any,
    workdir: Path,
    model: Path,
) -> dict[str, Any]:
    """Delta syncs (a handshake with ``delta=True``, over gloo like ``ours_s``): per changed fraction, two full
    syncs first (unmeasured: they fill the trainer ranks' shadows; the bitwise check before wrote the weights
    by other means), then ``warmup`` + ``syncs`` syncs after a synthetic step (``change``) of that fraction:
    deltas applying on the last, or full syncs where the senders' samples show more than
    ``delta_full_above`` changed (the 10% and 50% steps); median seconds, the trainer ranks' bytes per sync
    (heads included), and the bitwise check after the fraction's last sync."""
    rows = []
    state = 0
    step = 0
    for fraction in DELTA_FRACTIONS:
        # unmeasured: a sync of new weights (full: the handshake was new, or the bitwise check before wrote
        # the weights by other means), then one of the same weights (it refills the shadows where the first
        # did not: all of the weights had changed)
        pool.call(perturb)
        for _ in range(2):
            one_sync(step)
            step += 1
        seconds, moved, compared, changed = [], [], [], []
        for i in range(warmup + syncs):
            pool.call(change, fraction, step)
            start = time.perf_counter()
            t, w = one_sync(step)
            llm.reset_prefix_cache()
            took = time.perf_counter() - start
            step += 1
            state = max(state, *(int(r["delta_state_bytes"]) for r in t))
            kind = "delta" if all(r["delta_base"] is not None for r in t) else "full (fell back)"
            estimates = [r["estimated_changed_share"] for r in t if r["estimated_changed_share"] is not None]
            _log(
                f"{trainer} {fraction:.0%} changed, sync {i + 1}/{warmup + syncs}: {kind} {took:.3f} s, "
                f"{sum(r['bytes_sent'] for r in t) / 1e6:.2f} MB, changed "
                f"{sum(r['elements_changed'] for r in t)}/{sum(r['elements_compared'] for r in t)}, "
                f"sampled share {max(estimates, default=0.0):.4f}" + (" (warm-up)" if i < warmup else "")
            )
            _log(f"{trainer} {fraction:.0%} where the time went: {_where_time_went(t, w)}")
            if i >= warmup:
                seconds.append(took)
                moved.append(sum(int(r["bytes_sent"]) for r in t))
                compared.append(sum(int(r["elements_compared"]) for r in t))
                changed.append(sum(int(r["elements_changed"]) for r in t))
        equal, _ = _check_bitwise(pool, llm, workdir / f"check-{trainer}-delta", model)
        _log(
            f"{trainer} delta {fraction:.0%}: median {statistics.median(seconds):.3f} s, bitwise equal {equal}, "
            f"measured changed fraction {sum(changed) / max(sum(compared), 1):.4f}"
        )
        rows.append(
            {
                "changed_fraction": fraction,
                "ours_delta_s": round(statistics.median(seconds), 4),
                "delta_bytes_moved": max(moved),
                "bitwise_equal": bool(equal),
            }
        )
    return {"delta_rows": rows, "delta_state_bytes": state}


def _where_time_went(trainer: Sequence[Mapping[str, Any]], workers: Sequence[Mapping[str, Any]]) -> str:
    """Seconds by phase of the slowest trainer rank and of the slowest worker (``_phases``)."""
    ranks: dict[str, float] = {}
    for r in trainer:
        for k, v in (r.get("phase_seconds") or {}).items():
            ranks[k] = max(ranks.get(k, 0.0), round(float(v), 4))
    worst = max((float(w.get("total_seconds", 0.0)) for w in workers), default=0.0)
    return f"trainer {ranks}, workers {_phases(workers)}, slowest worker's receive {worst:.3f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sync", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rollout-sync")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: zero3, zero2")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--cap-mib", type=int, default=64, help="staging cap of ours, MiB")
    parser.add_argument(
        "--stand-in-packing",
        action="store_true",
        help="pack the dense linear layers with testbed.packing where vLLM keeps plain weights",
    )
    args = parser.parse_args(argv)
    rows_wanted = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows_wanted if r not in ROWS]
    if unknown or not rows_wanted:
        parser.error(f"--rows takes {ROWS}, found {args.rows!r}")
    if args.syncs < 1 or args.warmup < 0:
        parser.error("--syncs must be >= 1 and --warmup >= 0")
    os.environ["DS_ACCELERATOR"] = "cpu"
    from testbed.shaped_models import make_shaped_model

    start = time.perf_counter()
    model = make_shaped_model(MODEL_KIND, args.workdir / MODEL_KIND)
    _log(f"model {model} ready in {time.perf_counter() - start:.1f} s")
    rows = []
    for trainer in rows_wanted:
        rows.append(
            run_row(
                trainer,
                model,
                args.workdir,
                warmup=args.warmup,
                syncs=args.syncs,
                timeout=args.timeout,
                staging_cap_bytes=args.cap_mib << 20,
                stand_in=args.stand_in_packing,
            )
        )
        _log(f"row {json.dumps(rows[-1])}")
    print(
        f"{'trainer':8} {'ours s':>8} {'base s':>8} {'x':>6} {'ours tr MB':>11} {'base tr MB':>11} "
        f"{'ours ro MB':>11} {'base ro MB':>11} {'bitwise':>8} {'packed':>7} {'logits':>7}"
    )
    for r in rows:
        print(
            f"{r['trainer']:8} {r['ours_s']:8.2f} {r['baseline_s']:8.2f} {r['speedup'] or 0:6.2f} "
            f"{r['ours_trainer_extra_bytes'] / 1e6:11.1f} {r['baseline_trainer_extra_bytes'] / 1e6:11.1f} "
            f"{r['ours_rollout_extra_bytes'] / 1e6:11.1f} {r['baseline_rollout_extra_bytes'] / 1e6:11.1f} "
            f"{r['bitwise_equal']!s:>8} {r['packed_layers']:7d} {r['logits_equal']!s:>7}"
        )
    for r in rows:
        for d in r["delta_rows"]:
            print(
                f"{r['trainer']:8} delta {d['changed_fraction']:4.0%}: {d['ours_delta_s']:.3f} s against full "
                f"{r['full_s']:.3f} s ({d['ours_delta_s'] / r['full_s']:.2f}x), "
                f"{d['delta_bytes_moved'] / 1e6:.1f} MB against {r['ours_bytes_moved'] / 1e6:.1f} MB "
                f"({d['delta_bytes_moved'] / r['ours_bytes_moved']:.4f}), bitwise {d['bitwise_equal']}"
            )
        print(f"{r['trainer']:8} delta state (largest trainer rank): {r['delta_state_bytes'] / 1e6:.1f} MB")
    for r in rows:
        print(
            f"{r['trainer']:8} same host {r['ours_same_host_s']:.3f} s against gloo {r['ours_s']:.3f} s "
            f"({r['ours_s'] / r['ours_same_host_s']:.2f}x), trainer extra "
            f"{r['ours_same_host_trainer_extra_bytes'] / 1e6:.1f} MB, worker extra "
            f"{r['ours_same_host_rollout_extra_bytes'] / 1e6:.1f} MB, bitwise {r['same_host_bitwise_equal']}"
        )
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
