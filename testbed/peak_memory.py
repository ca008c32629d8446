"""Peak resident memory of this process during a block of work, measured by the kernel (Linux).

``PeakMemory.start()`` resets the process's high-water mark (``VmHWM``) to its current RSS by writing ``5``
to ``/proc/self/clear_refs`` and records ``VmRSS``; ``stop()`` reads ``VmHWM`` again. The extra bytes are
the high-water mark minus the RSS just before: what the block needed on top of what was already resident.
Where ``clear_refs`` cannot be written, a thread samples ``VmRSS`` every ``interval_s`` instead (a sampled
peak can miss short spikes; ``method`` says which was used).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["PeakMemory", "parse_status_kib"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def parse_status_kib(text: str, key: str) -> int:
    """The value of ``key`` (``VmRSS``, ``VmHWM``) in a ``/proc/<pid>/status`` text, in bytes."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            parts = rest.split()
            if len(parts) != 2 or parts[1] != "kB":
                raise ValueError(f"/proc status line for {key} is not '<n> kB': {line!r}")
            return int(parts[0]) * 1024
    raise KeyError(f"{key} not found in /proc status")


def _read(key: str) -> int:
    with open(_STATUS) as f:
        return parse_status_kib(f.read(), key)


@dataclass
class PeakMemory:
    interval_s: float = 0.005
    before: int = 0
    peak: int = 0
    method: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> PeakMemory:
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled"
        self.before = _read("VmRSS")
        self.peak = self.before
        if self.method == "sampled":
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _read("VmRSS"))

    def stop(self) -> int:
        """Stop measuring; returns the extra bytes (peak minus the RSS at ``start``, never negative)."""
        if self.method == "VmHWM":
            self.peak = max(self.peak, _read("VmHWM"))
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _read("VmRSS"))
        return max(self.peak - self.before, 0)
