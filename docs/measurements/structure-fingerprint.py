"""Fingerprint of plans, rank halves, dry-run facts and state maps; before/after a restructuring."""
import hashlib, json, subprocess, sys, importlib

def imp(*names):
    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError:
            pass
    raise ImportError(names)

shapes = imp("rollout_sync.shapes", "rollout_sync.models")
from rollout_sync.planning.planner import plan_model
from rollout_sync.planning.by_layout import plan_model_by_layout
from rollout_sync.planning.rank_half import plan_rank_half
from rollout_sync.planning.policy import Spread
wire = imp("rollout_sync.planning.wire")
tdr = imp("rollout_sync.trainer.shape_facts", "rollout_sync.trainer.dry_run")
from rollout_sync.trainer.storage_maps import state_maps

out = {}
def h(x): return hashlib.sha256(repr(x).encode()).hexdigest()[:16]

cases = [
    ("qwen3-0.6b", 3, 2, 1, 1, 1, 2, 1), ("qwen3-0.6b", 2, 2, 1, 1, 1, 2, 1), ("qwen3-8b", 3, 4, 2, 1, 2, 2, 1),
    ("qwen3-8b", 1, 2, 2, 1, 1, 4, 1), ("qwen3-30b-a3b", 3, 4, 1, 4, 2, 2, 1), ("qwen3-30b-a3b", 2, 4, 1, 2, 1, 4, 4),
    ("qwen3-30b-a3b", 0, 2, 1, 1, 1, 2, 2),
]
names = list(shapes.PRESETS)
out["presets"] = names
for model_name, zero, dp, tp, ep, engines, rtp, rep in cases:
    if model_name not in names:
        out[model_name] = "missing"; continue
    model = shapes.preset(model_name)
    T = dp * tp
    src = shapes.trainer_maps(model, zero, dp, tp, ep, "bfloat16")
    tgt = shapes.vllm_target_maps(model, engines, rtp, rep, T, "bfloat16")
    key = f"{model_name} z{zero} dp{dp} tp{tp} ep{ep} -> {engines}x tp{rtp} ep{rep}"
    rec = {"maps": h([repr(m) for m in src + tgt])}
    for pname, pol in (("lowest", "lowest"), ("spread", Spread())):
        p = plan_model(src, tgt, pol)
        q = plan_model_by_layout(src, tgt, pol)
        rec[pname] = [p.digest, q.digest, wire.plan_digest(q)]
        halves = []
        for r in (0, T - 1, T, T + engines * rtp - 1):
            half = plan_rank_half(src, tgt, r, pol)
            halves.append([half.traffic(), half.segment_count, h(wire.encode_half(half.with_digest(p.digest), compress=False)) if hasattr(half, "with_digest") else None])
        rec[pname + "_halves"] = halves
    out[key] = rec
    if zero in (0,1,2,3) and model.model_type in ("qwen3", "qwen3_moe") and not (ep > 1 and tp > 1):
        for rr in (False, True):
            facts = tdr.dry_run_facts(model, zero, dp, tp, ep, round_robin=rr)
            for state in ("param", "fp32", "exp_avg"):
                if zero == 0 and state != "param":
                    continue
                out[f"{key} facts rr={rr} {state}"] = h([repr(sm) for sm in state_maps(facts, state)])
print(json.dumps(out, indent=1, sort_keys=True))
