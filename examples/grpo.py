"""GRPO on a tiny model, with rollout-sync moving the weights after every optimizer step.

    python examples/grpo.py --verify                  # ZeRO-3 on 2 trainer ranks, vLLM at TP 2
    python examples/grpo.py --zero 2 --verify         # ZeRO-2: two replicas, balanced sends
    python examples/grpo.py --autotp 2 --verify       # AutoTP-2 (DeepSpeed tensor parallel)
    python examples/grpo.py --autoep 2 --verify       # AutoEP-2 on a tiny Qwen3-MoE
    python examples/grpo.py --delta --lr 1e-5 --steps 20  # delta syncs: only the changed weights move

One program on one machine, no download: it makes a tiny Qwen3 checkpoint locally, starts a vLLM engine
from it (this process drives it), and starts the DeepSpeed job on two trainer ranks (child processes).
Each step, vLLM samples a group of completions per prompt, a verifiable reward scores them (the share of
completion tokens in the lower half of the vocabulary), DeepSpeed takes a policy-gradient step with
group-normalised advantages, and the trainer hook syncs the new weights straight from DeepSpeed's storage
into vLLM's parameters. With ``--verify``, after each sync the trainer's weights (gathered by DeepSpeed
itself) are written into vLLM through vLLM's own loader maps, and the example says whether any bit changed.

With ``--delta`` every sync after the first sends only the elements that changed since the last one. Each
step then reports the share of the trainer's bf16 weights the step changed (counted on the trainer's own
storage, bit for bit) and the bytes the sync moved. A ``--verify`` check writes the weights through vLLM's
loader, which makes the next sync a full one, so with ``--delta`` it runs once, after the last step.

In a real job the trainer runs under the ``deepspeed`` launcher (``examples/two_programs``) and attaches
with three lines::

    from rollout_sync import TrainerSync
    sync = TrainerSync.attach(engine, address="tcp://HOST:PORT", engines=1)  # token: ROLLOUT_SYNC_TOKEN
    # ... engine.backward(loss); engine.step()  -> syncs after each applied optimizer step

and the vLLM side loads ``--worker-extension-cls vllm_plugin.extension.RolloutSyncExtension`` and calls
``setup_engines`` / ``connect_engine`` once and ``receive_sync`` per step. Here the trainer ranks are child
processes of this program (``examples/ranks.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOOD_TOKENS = range(4, 500)  # the reward: completion tokens with these ids (lower half of the vocabulary)


# ------------------------------------------------ trainer rank commands: fn(state, rank, world, *args)
def setup(state: dict[str, Any], rank: int, world: int, model: str, options: dict[str, Any]) -> float:
    """Join DeepSpeed's process group and build the engine (``options``: ``build_engine``'s); the seconds."""
    import torch
    from cpu import build_engine, init_distributed

    started = time.perf_counter()
    torch.set_num_threads(1)
    init_distributed()
    state["engine"] = build_engine(model, **options)
    state["autotp"] = options.get("autotp", 1)
    return time.perf_counter() - started


def attach(state: dict[str, Any], rank: int, world: int, address: str, token: str, delta: bool) -> int:
    """Attach rollout-sync (joins the handshake with the engine); this rank's rank in the sync group."""
    from rollout_sync import TrainerSync

    state["sync"] = TrainerSync.attach(state["engine"], address=address, engines=1, token=token, delta=delta)
    return int(state["sync"].endpoint.rank)


def grpo_step(
    state: dict[str, Any], rank: int, world: int, batch: list[tuple[list[int], list[int], float]]
) -> dict[str, Any]:
    """One policy-gradient step on this rank's share of the batch: loss = −mean(advantage × mean log-prob
    of the completion tokens). The sync runs inside ``engine.step()`` (the trainer hook). ``state``: the
    rank's ``engine``, its ``sync`` (``TrainerSync``), ``autotp`` (AutoTP ranks take the whole batch) and
    ``count_changes``; returns the loss, the sync's figures and, when counting, the stored elements the
    step changed."""
    import torch

    engine = state["engine"]
    mine = batch if state.get("autotp", 1) > 1 else batch[rank::world]
    width = max(len(p) + len(c) for p, c, _ in mine)
    ids = torch.zeros(len(mine), width, dtype=torch.long)
    mask = torch.zeros(len(mine), width, dtype=torch.bool)  # completion positions, as next-token targets
    for i, (p, c, _) in enumerate(mine):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) : len(p) + len(c)] = True
    advantages = torch.tensor([a for _, _, a in mine], dtype=torch.float32)
    logits = engine(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    target = mask[:, 1:]
    per_seq = (logp * target).sum(1) / target.sum(1).clamp(min=1)
    loss = -(advantages * per_seq).mean()
    sync = state["sync"]
    before = len(sync.history)
    stored = [p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in engine.module.parameters()]
    old = [t.clone() for t in stored] if state.get("count_changes") else []
    engine.backward(loss)
    engine.step()
    out: dict[str, Any] = {"loss": float(loss.detach())}
    if old:  # the weights this rank stores that the step changed, bit for bit
        out["elements"] = sum(t.numel() for t in stored)
        out["changed"] = sum(
            int(torch.count_nonzero(a.view(-1).view(torch.int16) != b.view(-1).view(torch.int16)))
            if a.element_size() == 2
            else int(torch.count_nonzero(a != b))
            for a, b in zip(old, stored, strict=True)
        )
    if len(sync.history) > before:
        last = sync.history[-1]
        out["sync"] = {"version": last.version, "seconds": last.seconds, "stats": last.stats.to_dict()}
    return out


def count_changes(state: dict[str, Any], rank: int, world: int) -> None:
    """From now on each ``grpo_step`` counts the stored weights its optimizer step changed."""
    state["count_changes"] = True


def delta_figures(results: list[dict[str, Any]], zero: int, autotp: int, autoep: int) -> dict[str, Any]:
    """One step's changed share of the trainer's weights (every rank's own storage; under ZeRO-0/1/2 without
    AutoTP/AutoEP every rank holds all of them, so rank 0 alone), and what the sync applied on."""
    ranks = results if zero == 3 or autotp > 1 or autoep > 1 else results[:1]
    stats = [r["sync"]["stats"] for r in results]
    compared = sum(s["elements_compared"] for s in stats)
    return {
        "delta_base": stats[0]["delta_base"],
        "changed_fraction": sum(r["changed"] for r in ranks) / max(sum(r["elements"] for r in ranks), 1),
        "sync_changed_fraction": sum(s["elements_changed"] for s in stats) / compared if compared else None,
        "bytes_sent": sum(sum(s["bytes_sent"].values()) for s in stats),
        "bytes_mapped": sum(sum(s["bytes_mapped"].values()) for s in stats),
    }


def save_weights(state: dict[str, Any], rank: int, world: int, out: str, model_dir: str) -> None:
    """The trainer's weights through DeepSpeed's own gathers, saved as a checkpoint (rank 0 writes)."""
    state["sync"].save_reference(model_dir, out)


# ------------------------------------------------------------------------------------------ the driver
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group size)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    ap.add_argument("--autotp", type=int, default=1, help="DeepSpeed AutoTP size (1: off)")
    ap.add_argument(
        "--autoep", type=int, default=1, help="DeepSpeed AutoEP size (1: off; uses the MoE model)"
    )
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor-parallel size")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument(
        "--verify",
        action="store_true",
        help="check after each sync that vLLM holds exactly the trainer's weights",
    )
    ap.add_argument(
        "--delta",
        action="store_true",
        help="after the first sync, send only the weights that changed (reports the changed share per step)",
    )
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rollout-sync-grpo"))
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    return ap.parse_args(argv)


def engine_env(tp: int) -> None:
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND",
        "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:tp]) if tp > 1 else "auto",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from ranks import Ranks, free_port
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from rollout_sync import connect_engine, receive_sync, setup_engines, verify_engine
    from rollout_sync.tiny import make_tiny_model

    kind = "moe" if args.autoep > 1 else "dense"
    work = Path(args.workdir)
    model = make_tiny_model(kind, work / f"tiny-{kind}", seed=0)
    trainers = 2
    print(
        f"[grpo] tiny {kind} model at {model}; trainer: ZeRO-{args.zero}, AutoTP {args.autotp}, AutoEP {args.autoep} on {trainers} ranks; vLLM TP {args.tp}",
        flush=True,
    )

    engine_env(args.tp)
    started = time.perf_counter()
    llm = LLM(
        model=str(model),
        tensor_parallel_size=args.tp,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=16,
        kv_cache_memory_bytes=64 * 2**20,
        seed=0,
        worker_extension_cls="vllm_plugin.extension.RolloutSyncExtension",
    )
    print(f"[grpo] vLLM engine up in {time.perf_counter() - started:.0f} s", flush=True)
    token = secrets.token_hex(16)
    options = {"zero": args.zero, "lr": args.lr, "autotp": args.autotp, "autoep": args.autoep}
    summary: dict[str, Any] = {"steps": []}
    with Ranks(
        trainers,
        env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        timeout=900,
    ) as ranks:
        setup_s = max(ranks.call(setup, str(model), options))
        print(f"[grpo] DeepSpeed engines up in {setup_s:.0f} s", flush=True)
        started = time.perf_counter()
        reports: list[list[dict[str, Any]]] = []
        setup_engines([llm], first_rank=trainers, reports=reports)
        found = reports[0][0]["setup"]
        print(
            f"[grpo] vLLM target maps in {time.perf_counter() - started:.2f} s ({found['maps']}: "
            f"{found['from_shapes']} tensors from shapes, checked by the loader trace in "
            f"{found['trace_seconds']:.2f} s; {found['probed']} probed element by element in "
            f"{found['probe_seconds']:.2f} s)",
            flush=True,
        )
        summary["rollout_setup_s"] = round(time.perf_counter() - started, 3)
        if args.verify:  # layers vLLM keeps packed (empty weights) are verified through their loaded form
            llm.collective_rpc("rollout_sync_record_loaded", args=(True,))
        address = f"tcp://127.0.0.1:{free_port()}"
        started = time.perf_counter()
        pending = ranks.submit(attach, address, token, args.delta)
        connect_engine(llm, address, 0, token=token)
        pending.result(240)
        print(f"[grpo] handshake, plan and sync group in {time.perf_counter() - started:.2f} s", flush=True)

        if args.delta:
            ranks.call(count_changes)
        gen = __import__("random").Random(0)
        bar = tqdm(range(1, args.steps + 1), desc="grpo", unit="step", file=sys.stdout)
        for step in bar:
            prompts = [[gen.randrange(4, 1000) for _ in range(6)] for _ in range(args.prompts)]
            params = SamplingParams(
                n=args.group, temperature=1.0, max_tokens=args.max_tokens, seed=step, ignore_eos=True
            )
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            batch, rewards = [], []
            for prompt, out in zip(prompts, outputs, strict=True):
                group = [list(c.token_ids) for c in out.outputs]
                scores = [sum(t in GOOD_TOKENS for t in c) / max(len(c), 1) for c in group]
                mean = sum(scores) / len(scores)
                std = (sum((s - mean) ** 2 for s in scores) / len(scores)) ** 0.5
                batch += [(prompt, c, (s - mean) / (std + 1e-4)) for c, s in zip(group, scores, strict=True)]
                rewards += scores
            pending = ranks.submit(grpo_step, batch)
            workers = receive_sync([llm])[0]  # blocks while the trainer ranks send; sets weight_version
            results = pending.result(300)
            sync = results[0]["sync"]
            # as messages, or copied by the workers straight from the trainer's storages they map (same host)
            moved = sum(sum(w["stats"]["bytes_received"].values()) for w in workers) + sum(
                sum(r["sync"]["stats"]["bytes_mapped"].values()) for r in results
            )
            row: dict[str, Any] = {
                "step": step,
                "reward": sum(rewards) / len(rewards),
                "loss": results[0]["loss"],
                "version": sync["version"],
                "sync_s": max(r["sync"]["seconds"] for r in results),
                "bytes_moved": moved,
                "rollout_versions": sorted({w["version"] for w in workers}),
                "vllm_weight_version": llm.get_weight_version(),
            }
            if args.delta:
                row.update(delta_figures(results, args.zero, args.autotp, args.autoep))
            if args.verify and (not args.delta or step == args.steps):
                ckpt = work / "verify" / f"step{step}"
                ranks.call(save_weights, str(ckpt), str(model))
                changed = len(verify_engine(llm, str(ckpt)))
                row["verified"] = changed == 0
                row["params_differing"] = changed
            summary["steps"].append(row)
            bar.write(
                f"step {step}: reward {row['reward']:.3f}  loss {row['loss']:+.4f}  sync v{row['version']} "
                f"(vLLM weight_version {row['vllm_weight_version']}) "
                f"{row['sync_s'] * 1000:.0f} ms, {moved / 1e3:.1f} KB moved"
                + (
                    f" ({'delta on v' + str(row['delta_base']) if row['delta_base'] is not None else 'full'}; "
                    f"the step changed {row['changed_fraction']:.2%} of the weights)"
                    if args.delta
                    else ""
                )
                + (
                    f"  vLLM == trainer, bit for bit: {'yes' if row['verified'] else f'NO ({changed} parameters differ)'}"
                    if "verified" in row
                    else ""
                )
            )
    ok = all(
        r.get("verified", True)
        and r["rollout_versions"] == [r["version"]]
        and r["vllm_weight_version"] == str(r["version"])
        for r in summary["steps"]
    )
    summary["ok"] = ok
    summary["bytes_moved_per_sync"] = [r["bytes_moved"] for r in summary["steps"]]
    if args.delta:
        summary["changed_fraction_per_step"] = [round(r["changed_fraction"], 6) for r in summary["steps"]]
        rest = summary["steps"][1:]
        if rest:
            print(
                f"[grpo] delta syncs: the steps changed {min(r['changed_fraction'] for r in rest):.3%}-"
                f"{max(r['changed_fraction'] for r in rest):.3%} of the weights; bytes moved per sync "
                f"{min(r['bytes_moved'] for r in rest) / 1e3:.1f}-{max(r['bytes_moved'] for r in rest) / 1e3:.1f} "
                f"KB against {summary['steps'][0]['bytes_moved'] / 1e3:.1f} KB for the first (full) sync",
                flush=True,
            )
    print(
        f"[grpo] {'all syncs verified bit for bit' if args.verify and ok else 'done' if ok else 'FAILED: see above'}",
        flush=True,
    )
    if args.json:
        print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
