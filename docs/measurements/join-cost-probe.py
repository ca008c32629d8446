"""Does an engine joining a group-free sync (backend ``nixl``) slow the others down? Engine-free session ranks
(``tests/hosts/session_rank.py``) across emulated hosts: trainer ranks (ZeRO-3 partitions of the session model)
on host a, engine 0 (TP 2) on host b, engine 1 on host c, the links of b and c each shaped to RATE; engine 1
starts after sync 3 and joins through the admission desk. Prints engine 0's workers' read seconds (waiting for
their reads, ``PullEndpoint`` phase ``read``) per sync, alone (syncs 1-3) and beside engine 1 (syncs 4-6),
and their ratio. Run from the checkout as root: ``python docs/measurements/join-cost-probe.py [RATE_BPS]``."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testbed.hosts import Hosts
from tests.hosts import test_session_hosts as session


def main() -> None:
    rate = int(float(sys.argv[1])) if len(sys.argv) > 1 else 10**7
    with tempfile.TemporaryDirectory() as tmp, Hosts(["a", "b", "c"]) as hosts:
        control = Path(tmp)
        ctl = ["--control", tmp, "--timeout", "60"]
        early = [
            *session.trainers("a", "--backend", "nixl", "--syncs", "1,2,3,4,5,6", *ctl),
            *session.engine(0, "b", "--syncs", "1,2,3,4,5,6", "--timeout", "60"),
        ]
        late = session.engine(1, "c", "--syncs", "4,5,6", "--timeout", "60")
        for host in ("b", "c"):
            hosts.shape(host, rate_bps=rate)
        address = f"tcp://{hosts.name_of('a')}:{session.PORT}"
        session.start(hosts, early, address, timeout=60)
        for v in (1, 2, 3):
            session.go(control, v)
            session.until(lambda v=v: all(session.lines_for(early, v)), 120, f"sync {v}")
        session.start(hosts, late, address, timeout=60)
        session.until(lambda: all(any("joined" in x for x in r.lines) for r in late), 120, "engine 1 joining")
        for v in (4, 5, 6):
            session.go(control, v)
            session.until(lambda v=v: all(session.lines_for([*early, *late], v)), 120, f"sync {v}")
        session.finish([*early, *late])
    per_sync = {v: max(session.syncs(r)[v]["read_s"] for r in early[2:]) for v in (1, 2, 3, 4, 5, 6)}
    alone = statistics.median(per_sync[v] for v in (1, 2, 3))
    beside = statistics.median(per_sync[v] for v in (4, 5, 6))
    late_reads = {v: max(session.syncs(r)[v]["read_s"] for r in late) for v in (4, 5, 6)}
    wrong = [x["wrong"] for r in [*early[2:], *late] for x in session.syncs(r).values() if x["wrong"]]
    print(
        json.dumps(
            {
                "rate_bps": rate,
                "engine0_read_s": per_sync,
                "engine1_read_s": late_reads,
                "alone_s": round(alone, 4),
                "beside_s": round(beside, 4),
                "beside_over_alone": round(beside / alone, 3),
                "bitwise_equal": not wrong,
            }
        )
    )


if __name__ == "__main__":
    main()
