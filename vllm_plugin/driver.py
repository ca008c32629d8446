"""Driver-side helpers for one or several vLLM engines loaded with ``RolloutSyncExtension``.

An engine is anything with vLLM's ``collective_rpc(method, args=(), kwargs=None)`` (``vllm.LLM``; an
``AsyncLLM`` needs an async wrapper), or a served engine (``http_driver.ServerEngine``). Engines are numbered
in the order given: engine ``k``'s workers are global ranks ``first_rank + (workers of engines before k) +
tp_rank``. Every call carries its own nonce and a worker's failure comes back as an answer, never as a
raised RPC error (``vllm_plugin.calls``): after a failed call the engine's next call gets its own answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sync.errors import PeerFailedError
from rollout_sync.rollout.codec import local_targets_from_dict
from rollout_sync.rollout.fleet_maps import RolloutTargets, assemble
from rollout_sync.rollout.landing_maps import DEFAULT_MAX_PIECES
from rollout_sync.sync.options import SyncOptions

from .calls import call

__all__ = [
    "apply_checkpoint",
    "connect_engine",
    "engine_status",
    "receive_sync",
    "setup_engines",
    "verify_engine",
    "weight_digests",
]


def setup_engines(
    engines: Sequence[Any],
    first_rank: int = 0,
    *,
    tensors: Mapping[str, Sequence[int]] | None = None,
    max_pieces: int = DEFAULT_MAX_PIECES,
    maps: str | None = None,
    reports: list[list[dict[str, Any]]] | None = None,
    lora: Mapping[str, Any] | None = None,
) -> RolloutTargets:
    """Set up every worker of every engine (``maps``: how workers learn their targets, ``"fast"``,
    ``"probe"`` or ``"verify"``, ``vllm_plugin.worker_maps``; None: the extension's default) and return the merged, coverage-checked target
    maps. ``reports``, if given, receives each engine's worker summaries (with their setup reports).
    ``lora``: sync a LoRA adapter into a slot of each engine instead of the weights
    (``vllm_plugin.lora_slots.AdapterSpec`` as a dict: ``name``, ``lora_id``, ``rank``, ``scaling``,
    ``target_modules``); requests name it with ``LoRARequest(name, lora_id, lora_path)`` (the path is never
    read)."""
    ranks: list[tuple[int, ...]] = []
    refused: dict[str, list[int]] = {}
    next_rank = first_rank
    for k, engine in enumerate(engines):
        kwargs: dict[str, Any] = {
            "first_rank": next_rank,
            "tensors": {k: list(v) for k, v in tensors.items()} if tensors else None,
            "max_pieces": max_pieces,
        }
        if maps is not None:
            kwargs["maps"] = maps
        if lora is not None:
            kwargs["lora"] = dict(lora)
        summaries = call(engine, "setup", name=str(k), kwargs=kwargs)
        got = tuple(int(s["rank"]) for s in summaries)
        expected = tuple(range(next_rank, next_rank + len(summaries)))
        if got != expected:
            raise PeerFailedError(f"engine {len(ranks)} reported ranks {got}, expected {expected}")
        for s in summaries:
            for name in s["refused"]:
                refused.setdefault(name, []).append(int(s["rank"]))
        if reports is not None:
            reports.append([dict(s) for s in summaries])
        ranks.append(got)
        next_rank += len(summaries)
    for name, holders in sorted(refused.items()):
        # One map per tensor: a tensor refused on some rank is staged whole on every rank.
        reason = f"staged whole on every rank: refused for in-place writes on ranks {sorted(holders)}"
        for k, engine in enumerate(engines):
            call(engine, "fallback", args=([name], reason), name=str(k))
    workers = []
    for k, engine in enumerate(engines):
        workers += [local_targets_from_dict(d) for d in call(engine, "local_targets", name=str(k))]
    return assemble(workers, ranks)


def connect_engine(
    engine: Any,
    address: str,
    index: int = 0,
    *,
    token: str | None = None,
    timeout: float = SyncOptions.timeout,
    staging_cap_bytes: int | None = None,
    atomic: bool = False,
) -> list[dict[str, Any]]:
    """Join engine ``index``'s workers to the sync group through the coordinator at ``address`` (blocks
    until every trainer rank and worker has joined: run it beside ``TrainerSync.attach``). A refused
    handshake raises ``PeerFailedError`` naming the engine and each worker's error; the engine's next call
    (a ``status``, a second handshake) gets its own answers. ``atomic``: every sync lands whole or not at
    all, a failed one leaves the old weights (each worker holds a copy of its weights during a sync)."""
    kwargs: dict[str, Any] = {"address": address, "engine": index, "token": token, "timeout": timeout}
    if staging_cap_bytes is not None:
        kwargs["staging_cap_bytes"] = staging_cap_bytes
    if atomic:
        kwargs["atomic"] = True
    return list(call(engine, "connect", kwargs=kwargs, name=str(index)))


def weight_digests(engine: Any, name: str = "0") -> list[dict[str, str]]:
    """Per worker, the SHA-256 of every parameter and, under ``"<name> (loaded form)"``, of the loaded form
    the last recorded update wrote into each layer vLLM keeps in another form (its weight is empty: the
    loaded form is what a sync writes; ``rollout_sync_record_loaded``)."""
    params = call(engine, "param_digests", name=name)
    loaded = call(engine, "loaded_digests", name=name)
    return [
        {**p, **{f"{n} (loaded form)": d for n, d in w.items()}} for p, w in zip(params, loaded, strict=True)
    ]


def engine_status(engine: Any, name: str = "0") -> list[dict[str, Any]]:
    """Each worker's link state (``rollout_sync_status``): rank, version, ``incomplete``, last error."""
    return list(call(engine, "status", name=name))


def apply_checkpoint(
    engines: Sequence[Any], path: str, names: Sequence[str] | None = None
) -> list[list[Any]]:
    """Write a checkpoint into every engine through the maps (one call per engine, so no generation runs
    in between on that engine), then reset each engine's prefix cache. Returns each worker's report."""
    reports = []
    for k, engine in enumerate(engines):
        reports.append(list(call(engine, "apply_checkpoint", args=(str(path), names), name=str(k))))
        reset = getattr(engine, "reset_prefix_cache", None)
        if callable(reset):
            reset()
    return reports


def verify_engine(engine: Any, checkpoint: str) -> list[str]:
    """Check a sync: write ``checkpoint`` (the trainer's weights as DeepSpeed itself gathers them,
    ``TrainerSync.save_reference``) into ``engine`` through vLLM's own loader maps, and name the parameters
    (of any worker; ``"<name> (loaded form)"`` for a layer vLLM keeps in another form, once
    ``rollout_sync_record_loaded`` is on) whose bytes that changed. Empty: the engine held exactly the
    trainer's weights, bit for bit. No generation may run meanwhile. Slow next to a sync."""
    before = weight_digests(engine)
    apply_checkpoint([engine], checkpoint)
    after = weight_digests(engine)
    return sorted({n for b, a in zip(before, after, strict=True) for n in b if a.get(n) != b[n]})


def receive_sync(engines: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """Receive one sync on every engine (call while the trainer ranks send; no generation may run), then
    reset each engine's prefix cache and set vLLM's ``weight_version`` to the version the trainer sent.
    Raises if a worker reports another version than the others: no engine claims a version it did not get.

    The engines' ``rollout_sync_receive`` calls run concurrently (one thread per engine), since each blocks
    until every rank of the sync group has committed."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(len(engines), 1)) as pool:
        futures = [pool.submit(call, engine, "receive", name=str(k)) for k, engine in enumerate(engines)]
        reports = [list(f.result()) for f in futures]
    versions = {int(r["version"]) for per_engine in reports for r in per_engine}
    if len(versions) != 1:
        raise PeerFailedError(f"workers report different weight versions after a sync: {sorted(versions)}")
    version = str(versions.pop())
    for engine in engines:
        reset = getattr(engine, "reset_prefix_cache", None)
        if callable(reset):
            reset()
        set_version = getattr(engine, "update_weight_version", None)
        if callable(set_version):
            set_version(version)
    return reports
