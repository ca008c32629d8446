"""Scratch driver (run from the checkout with .venv active): bench sync zero2 row, ours over gloo only, per-process CPU seconds per sync. Env: N syncs, PAUSE s before each, PERF / PYSPY to profile worker 0."""
import os, sys, time, json
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
os.environ["DS_ACCELERATOR"] = "cpu"
import psutil
from pathlib import Path
from rollout_sync.bench import sync as B
from testbed.shaped_models import make_shaped_model
from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankPool, free_port
from testbed.trainer_ranks import attach, setup
from vllm_plugin.driver import setup_engines

def main():
    N = int(os.environ.get("N", "6"))
    PAUSE = float(os.environ.get("PAUSE", "0"))
    workdir = Path.home() / ".cache" / "rollout-sync"
    model = make_shaped_model(B.MODEL_KIND, workdir / B.MODEL_KIND)
    extra = {"zero_allow_untested_optimizer": True, "zero_optimization": dict(B.BUCKETS)}
    spec = DeepSpeedSpec("dense-tied", zero_stage=2, optimizer="sgd", extra_config=extra)
    def cpu(pids):
        out = {}
        for name, pid in pids.items():
            try:
                t = psutil.Process(pid).cpu_times(); out[name] = t.user + t.system
            except psutil.Error: out[name] = 0.0
        return out
    with RankPool(B.TRAINERS, env=B.TRAINER_ENV, timeout=1200) as pool:
        before = B._descendants()
        llm, pids = B.start_engine(model)
        B._pack(llm, False)
        setup_engines([llm], first_rank=B.TRAINERS)
        pool.call(setup, spec, str(model))
        names = {}
        for p in psutil.Process().children(recursive=True):
            cmd = " ".join(p.cmdline())
            if "EngineCore" in p.name() or "EngineCore" in cmd: names["core"] = p.pid
            elif "Worker_TP0" in cmd or "Worker_TP0" in p.name(): names["w0"] = p.pid
            elif "Worker_TP1" in cmd or "Worker_TP1" in p.name(): names["w1"] = p.pid
            elif "spawn_main" in cmd: names[f"t{len([k for k in names if k.startswith('t')])}"] = p.pid
        names["driver"] = os.getpid()
        print("pids", names, file=sys.stderr)
        address = f"tcp://127.0.0.1:{free_port()}"
        pending = pool.submit(attach, address, B.TOKEN, 1, None, "balanced", 300.0, 64 << 20, False, False)
        llm.collective_rpc("rollout_sync_connect", kwargs={"address": address, "engine": 0, "token": B.TOKEN, "timeout": 300.0, "staging_cap_bytes": 64 << 20})
        pending.result(600)
        rows = []
        import subprocess, signal
        perf = None
        for i in range(N):
            pool.call(B.perturb)
            if i == 2 and os.environ.get("PERF"):
                perf = subprocess.Popen(["perf", "record", "-F", "1999", "-o", "/tmp/perf-w0.data", "-p", f"{names['w0']},{names['t0']}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            if i == 2 and os.environ.get("PYSPY"):
                perf = subprocess.Popen(["py-spy", "record", "-p", str(names['w0']), "-o", "/tmp/w0-spy.txt", "-f", "raw", "-r", "250", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            if PAUSE: time.sleep(PAUSE)
            c0 = cpu(names); t0 = time.perf_counter()
            p = pool.submit(B.ours_sync, i + 1)
            w = llm.collective_rpc("rollout_sync_bench_receive")
            tr = p.result(600)
            llm.reset_prefix_cache()
            dt = time.perf_counter() - t0; c1 = cpu(names)
            d = {k: round(c1[k] - c0[k], 3) for k in names}
            print(f"sync {i}: {dt:.3f} s cpu {d} total {sum(d.values()):.2f}", file=sys.stderr)
            rows.append((dt, d))
            if perf is not None and i == N - 1:
                perf.send_signal(signal.SIGINT); perf.wait()
            if i == N - 1:
                print(json.dumps(w[0], default=str)[:3000], file=sys.stderr)
        B.stop_engine(llm, pids)

if __name__ == '__main__':
    main()
