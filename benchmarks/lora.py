"""LoRA syncs against TRL's PEFT sync: ``python -m benchmarks lora [--json]``.

Qwen3-0.6B's shapes (``testbed.shaped_models``), a PEFT LoRA adapter of rank 16 on every linear layer
(``lora_alpha`` 32), DeepSpeed ZeRO-3 on 2 trainer ranks, one vLLM engine at TP 2 on the same 2-core host.

- **adapter** rows: ours syncs the adapter's A and B into a LoRA slot of an engine started with
  ``enable_lora`` (``setup_engines(..., lora=...)``, over gloo, as ``bench sync``'s ``ours_s``); ``equal``: the
  engine asked for the synced adapter gives the greedy tokens and raw logits of the same engine loading
  the adapter DeepSpeed's own gathers saved as a PEFT checkpoint. Two rows: vLLM's default LoRA layers keep
  a column-parallel layer's A and a row-parallel layer's B whole on every TP rank (each of those moves once
  per worker); with ``fully_sharded_loras`` every element is stored by one worker and moves once.
- The baseline is what TRL 1.16 does for a PEFT model under ZeRO-3 (``VLLMGeneration.sync_weights``):
  gather every parameter on every rank (``GatheredParameters`` over the whole model), ``merge_adapter``,
  send every merged base weight (here broadcast from rank 0 to the engine's workers, which load each
  through vLLM's ``load_weights``, as the OpenRLHF-style baseline of ``bench sync``), ``unmerge_adapter``;
  into an engine without LoRA, as TRL runs it.
- **merged** row: vLLM's base weights become ``W + s·B·A``, into the engine without LoRA the baseline uses
  (``attach(..., lora="merged")``: each trainer rank merges the base storage it holds; ``trainer.merged``);
  ``equal``: writing PEFT's own ``merge_and_unload`` of DeepSpeed's gathered weights into the engine
  afterwards changes no weight, no packed layer's loaded form and no logit. ``trainer_extra_bytes``
  includes the merged buffers a rank keeps between syncs (``trainer_kept_bytes``).

Keys per row: ``mode``, ``ours_s``, ``baseline_s``, ``speedup``, ``bytes_moved`` (ours: bytes the trainer
ranks sent), ``baseline_bytes_moved``, ``adapter_bytes`` (A and B once), ``trainer_extra_bytes`` and
``baseline_trainer_extra_bytes`` (largest trainer rank's RSS high-water mark above its start, plus the
staging it keeps), ``equal``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from testbed.rank_pool import RankContext

from .sync import (
    MODEL_KIND,
    TOKEN,
    TP,
    TRAINER_ENV,
    TRAINERS,
    baseline_connect,
    detach,
    ours_sync,
    perturb,
    start_engine,
    stop_engine,
)

RANK = 16
LORA = {"r": RANK, "lora_alpha": 2 * RANK, "target_modules": "all-linear", "lora_dropout": 0.0}
BASELINE_PORT_OFFSET = 1
SYNCED_ID = 1


def _log(msg: str) -> None:
    print(f"[bench lora {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _hf_name(name: str) -> str:
    """A PEFT model's base parameter name as the checkpoint (and vLLM's ``load_weights``) names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _merged_params(model: Any) -> list[tuple[str, Any]]:
    """The parameters TRL sends after ``merge_adapter``: every one but the adapter's own."""
    return [(n, p) for n, p in model.named_parameters() if "lora_" not in n and "original_module" not in n]


def merged_specs(ctx: RankContext) -> list[tuple[str, list[int], str]]:
    model = ctx.state["engine"].module
    out = []
    for name, p in _merged_params(model):
        shape = list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape)
        out.append((_hf_name(name), shape, str(p.dtype).removeprefix("torch.")))
    return out


def trl_peft_sync(ctx: RankContext) -> dict[str, Any]:
    """TRL 1.16's sync of a PEFT model under ZeRO-3: gather the whole model, merge, send, unmerge."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from testbed.peak_memory import PeakMemory

    model = ctx.state["engine"].module
    group = ctx.state.get("baseline_group")
    receivers = group.size() - 1 if group is not None else 0
    memory = PeakMemory().start()
    start = time.perf_counter()
    sent = 0
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(model.parameters())):
        model.merge_adapter()
        for _, p in _merged_params(model):
            if group is not None:
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                group.broadcast([p.data], opts).wait()
                sent += p.data.numel() * p.data.element_size() * receivers
        model.unmerge_adapter()
    return {
        "rank": ctx.rank,
        "seconds": time.perf_counter() - start,
        "extra_bytes": memory.stop(),
        "bytes_sent": sent,
    }


def save_adapter(ctx: RankContext, out: str) -> list[str]:
    from rollout_sync.trainer.reference import save_adapter as save

    return save(ctx.state["engine"], out)


def _outputs(llm: Any, request: Any) -> tuple[list[list[int]], list[list[list[float]]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=-1)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [100, 200, 300]}]
    outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logits = [[[v.logprob for _, v in sorted(pos.items())] for pos in o.outputs[0].logprobs] for o in outs]
    return tokens, logits


def _timed(
    label: str, once: Any, warmup: int, syncs: int, pool: Any
) -> tuple[float, list[list[dict[str, Any]]]]:
    seconds, reports = [], []
    for i in range(warmup + syncs):
        pool.call(perturb)
        start = time.perf_counter()
        reports_i = once(i)
        took = time.perf_counter() - start
        _log(f"{label} sync {i + 1}/{warmup + syncs}: {took:.3f} s{' (warm-up)' if i < warmup else ''}")
        if i >= warmup:
            seconds.append(took)
            reports.append(reports_i)
    return statistics.median(seconds), reports


def _ours(
    pool: Any,
    model: Path,
    workdir: Path,
    adapter: dict[str, Any],
    sharded: bool,
    warmup: int,
    syncs: int,
    timeout: float,
) -> dict[str, Any]:
    """Adapter syncs into an engine with LoRA (``fully_sharded_loras`` as ``sharded``): median seconds, the
    reports, and whether the synced adapter serves as its PEFT checkpoint does."""
    from vllm.lora.request import LoRARequest

    from testbed.rank_pool import free_port
    from testbed.trainer_ranks import attach
    from vllm_plugin.driver import setup_engines

    label = f"adapter ours{' (fully_sharded_loras)' if sharded else ''}"
    llm, pids = start_engine(
        model, enable_lora=True, max_lora_rank=RANK, max_loras=2, fully_sharded_loras=sharded
    )
    try:
        setup_engines([llm], first_rank=TRAINERS, lora=adapter)
        address = f"tcp://127.0.0.1:{free_port()}"
        pending = pool.submit(attach, address, TOKEN, 1, None, "balanced", timeout, None, False)
        llm.collective_rpc(
            "rollout_sync_connect",
            kwargs={"address": address, "engine": 0, "token": TOKEN, "timeout": timeout},
        )
        pending.result(timeout * 2)

        def once(i: int) -> list[dict[str, Any]]:
            pending = pool.submit(ours_sync, i + 1)
            llm.collective_rpc("rollout_sync_bench_receive")
            return list(pending.result(timeout * 4))

        seconds, reports = _timed(label, once, warmup, syncs, pool)
        saved = workdir / "bench-lora-adapter"
        pool.call(save_adapter, str(saved))
        synced = _outputs(llm, LoRARequest("policy", SYNCED_ID, "never-read"))
        loaded = _outputs(llm, LoRARequest("peft-checkpoint", SYNCED_ID + 1, str(saved)))
        _log(f"{label} {seconds:.3f} s; tokens and logits equal to the PEFT checkpoint's: {synced == loaded}")
        pool.call(detach)
    finally:
        stop_engine(llm, pids)
    return {"seconds": seconds, "reports": reports, "equal": synced == loaded, "sharded": sharded}


def merged_kept_bytes(ctx: RankContext) -> int:
    merged = ctx.state["sync"].merged
    return 0 if merged is None else int(merged.bytes)


def save_merged(ctx: RankContext, out: str, model_dir: str) -> None:
    from rollout_sync.trainer.reference import save_merged as save

    save(ctx.state["engine"], model_dir, out)


def _ours_merged(
    pool: Any, llm: Any, model: Path, workdir: Path, warmup: int, syncs: int, timeout: float
) -> dict[str, Any]:
    """Merged syncs into ``llm`` (set up, without LoRA); ``equal``: writing PEFT's own ``merge_and_unload``
    of DeepSpeed's gathered weights through vLLM's loaders afterwards changes no weight, no loaded form of
    a packed layer and no logit."""
    from testbed.rank_pool import free_port
    from testbed.trainer_ranks import attach
    from vllm_plugin.driver import apply_checkpoint, weight_digests

    from .sync import _logits

    llm.collective_rpc("rollout_sync_record_loaded", args=(True,))
    address = f"tcp://127.0.0.1:{free_port()}"
    pending = pool.submit(
        attach, address, TOKEN, 1, None, "balanced", timeout, None, False, False, "gloo", "merged"
    )
    llm.collective_rpc(
        "rollout_sync_connect", kwargs={"address": address, "engine": 0, "token": TOKEN, "timeout": timeout}
    )
    pending.result(timeout * 2)

    def once(i: int) -> list[dict[str, Any]]:
        pending = pool.submit(ours_sync, i + 1)
        llm.collective_rpc("rollout_sync_bench_receive")
        llm.reset_prefix_cache()
        return list(pending.result(timeout * 4))

    seconds, reports = _timed("merged ours", once, warmup, syncs, pool)
    kept = max(pool.call(merged_kept_bytes))
    synced = (weight_digests(llm), llm.collective_rpc("rollout_sync_loaded_digests"), _logits(llm))
    checkpoint = workdir / "bench-lora-merged"
    pool.call(save_merged, str(checkpoint), str(model))
    apply_checkpoint([llm], str(checkpoint))
    written = (weight_digests(llm), llm.collective_rpc("rollout_sync_loaded_digests"), _logits(llm))
    equal = synced == written
    _log(f"merged ours {seconds:.3f} s; equal to PEFT's merge_and_unload: {equal}; kept {kept / 1e6:.1f} MB")
    llm.collective_rpc("rollout_sync_record_loaded", args=(False,))
    pool.call(detach)
    return {"seconds": seconds, "reports": reports, "equal": equal, "kept_bytes": kept}


def run(model: Path, workdir: Path, *, warmup: int, syncs: int, timeout: float) -> list[dict[str, Any]]:
    from rollout_sync.trainer.adapter import adapter_config
    from testbed.deepspeed import DeepSpeedSpec
    from testbed.rank_pool import RankPool, free_port
    from testbed.trainer_ranks import setup
    from vllm_plugin.driver import setup_engines

    spec = DeepSpeedSpec(
        "dense-tied",
        zero_stage=3,
        optimizer="sgd",
        extra_config={"zero_allow_untested_optimizer": True},
        lora=LORA,
    )
    adapter = adapter_config({"default": {"peft_type": "LORA", **LORA}}).spec("policy", SYNCED_ID)
    with RankPool(TRAINERS, env=TRAINER_ENV, timeout=timeout * 4) as pool:
        pool.call(setup, spec, str(model))
        _log("DeepSpeed ZeRO-3 with a PEFT adapter built")
        ours_rows = []
        for sharded in (False, True):
            ours_rows.append(_ours(pool, model, workdir, adapter, sharded, warmup, syncs, timeout))
        llm, pids = start_engine(model)
        try:
            setup_engines([llm], first_rank=TRAINERS)
            merged = _ours_merged(pool, llm, model, workdir, warmup, syncs, timeout)
            port = free_port()
            world = 1 + TP
            pending = pool.submit(baseline_connect, "127.0.0.1", port, world, timeout)
            llm.collective_rpc("openrlhf_baseline_connect", args=("127.0.0.1", port, world, 1, timeout))
            pending.result(timeout * 2)
            specs = pool.call(merged_specs)[0]

            def baseline_once(i: int) -> list[dict[str, Any]]:
                pending = pool.submit(trl_peft_sync)
                llm.collective_rpc("openrlhf_baseline_receive", args=(specs,))
                return list(pending.result(timeout * 8))

            baseline_s, baseline = _timed("TRL PEFT baseline", baseline_once, warmup, syncs, pool)
        finally:
            stop_engine(llm, pids)
    adapter_bytes = _adapter_bytes()
    baseline_moved = max(sum(int(r["bytes_sent"]) for r in sync) for sync in baseline)
    baseline_extra = max(int(r["extra_bytes"]) for sync in baseline for r in sync)
    rows: list[dict[str, Any]] = [
        {
            "mode": "adapter",
            "fully_sharded_loras": ours["sharded"],
            "ours_s": round(ours["seconds"], 4),
            "baseline_s": round(baseline_s, 4),
            "speedup": round(baseline_s / ours["seconds"], 2),
            "bytes_moved": max(sum(int(r["bytes_sent"]) for r in sync) for sync in ours["reports"]),
            "baseline_bytes_moved": baseline_moved,
            "adapter_bytes": adapter_bytes,
            "trainer_extra_bytes": max(int(r["extra_bytes"]) for sync in ours["reports"] for r in sync),
            "baseline_trainer_extra_bytes": baseline_extra,
            "equal": bool(ours["equal"]),
        }
        for ours in ours_rows
    ]
    return [
        *rows,
        {
            "mode": "merged",
            "ours_s": round(merged["seconds"], 4),
            "baseline_s": round(baseline_s, 4),
            "speedup": round(baseline_s / merged["seconds"], 2),
            "bytes_moved": max(sum(int(r["bytes_sent"]) for r in sync) for sync in merged["reports"]),
            "baseline_bytes_moved": baseline_moved,
            "adapter_bytes": adapter_bytes,
            # the merged buffers kept between syncs (allocated at attach) and the sync's own high-water mark
            "trainer_extra_bytes": max(
                int(r["extra_bytes"]) + merged["kept_bytes"] for sync in merged["reports"] for r in sync
            ),
            "trainer_kept_bytes": merged["kept_bytes"],
            "baseline_trainer_extra_bytes": baseline_extra,
            "equal": bool(merged["equal"]),
        },
    ]


def _adapter_bytes() -> int:
    """Bytes of the adapter's A and B once (bf16), from the model's shapes."""
    from rollout_sync.shapes.presets import preset

    total = 0
    for t in preset("qwen3-0.6b").tensors:
        if t.name.endswith("_proj.weight") and len(t.shape) == 2:
            out, inp = t.shape
            total += 2 * RANK * (out + inp)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rollout-sync")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.syncs < 1 or args.warmup < 0:
        parser.error("--syncs must be >= 1 and --warmup >= 0")
    os.environ["DS_ACCELERATOR"] = "cpu"
    from testbed.shaped_models import make_shaped_model

    model = make_shaped_model(MODEL_KIND, args.workdir / MODEL_KIND)
    rows = run(model, args.workdir, warmup=args.warmup, syncs=args.syncs, timeout=args.timeout)
    for r in rows:
        sharded = r.get("fully_sharded_loras")
        engine = "no LoRA" if sharded is None else "fully sharded" if sharded else "default"
        print(
            f"{r['mode']:8} {engine:13} ours {r['ours_s']:.3f} s, baseline {r['baseline_s']:.3f} s ({r['speedup']}x); moved "
            f"{r['bytes_moved'] / 1e6:.1f} MB ({r['bytes_moved'] / r['adapter_bytes']:.2f}x the adapter's "
            f"{r['adapter_bytes'] / 1e6:.1f} MB) against {r['baseline_bytes_moved'] / 1e6:.1f} MB; trainer extra "
            f"{r['trainer_extra_bytes'] / 1e6:.1f} MB against {r['baseline_trainer_extra_bytes'] / 1e6:.1f} MB; "
            f"equal {r['equal']}"
        )
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0
