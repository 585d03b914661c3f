"""The CPU's last-level cache, as the OS reports it: on a CPU the cache-level copy ceiling.

A GPU row compares with the L2 copy rate when its working set fits in L2 and the caches are warm;
a CPU is always timed warm (nothing flushes its caches between calls), so a working set that fits
in the last-level cache is served from there, not from DRAM, and must be compared with that
cache's bandwidth, not the large-copy figure. Linux publishes the cache sizes in sysfs; elsewhere
the size is unknown (None) and every row keeps the DRAM roof.
"""
from pathlib import Path

SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
MEASURE_FRACTION = 0.5      # of the cache the copy that measures its bandwidth fills (as phase1.ceilings'
                            # l2_fraction on a GPU); a working set up to the whole cache is compared with it


def parse_size(text: str) -> int | None:
    """'32768K' -> 33554432; None for anything else."""
    text = text.strip()
    if not text:
        return None
    unit = UNITS.get(text[-1].upper(), 1)
    digits = text[:-1] if text[-1].upper() in UNITS else text
    return int(digits) * unit if digits.isdigit() else None


def last_level_cache(root: Path = SYSFS) -> tuple[int, int] | None:
    """(level, bytes) of the largest data or unified cache of CPU 0, or None where unknown."""
    best = None
    for index in sorted(root.glob("index*")) if root.is_dir() else []:
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size and (best is None or level > best[0]):
            best = (level, size)
    return best
