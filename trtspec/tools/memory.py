"""Peak resident memory of a process (ours or a peer's server), from /proc on Linux."""
from __future__ import annotations

import re
from pathlib import Path


def status_mb(key: str, pid: int | str = "self") -> float | None:
    """A /proc/PID/status size (VmRSS, VmHWM) in MiB; None where it cannot be read."""
    try:
        m = re.search(rf"^{key}:\s+(\d+)\s+kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        m = None
    if m:
        return int(m.group(1)) / 1024
    if key == "VmHWM" and pid == "self":
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: kB
    return None


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset a process's VmHWM (Linux >= 4.0); False where not allowed (peaks are then cumulative)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
