"""What a run cost: $/hour times the seconds it took.

The rate comes from, in order: the --usd-per-hour flag, the LAB_USD_PER_HOUR environment variable
(what you actually pay for your rental), or the reference on-demand price in hardware.yaml.
"""
import math
import os

from .errors import LabError
from .hardware import HardwareSpec


def hourly_rate(spec: HardwareSpec | None, flag: float | None = None) -> tuple[float | None, str | None]:
    if flag is not None:
        if not math.isfinite(flag) or flag < 0:
            raise LabError("--usd-per-hour must be a finite number >= 0")
        return float(flag), "--usd-per-hour flag"
    env = os.environ.get("LAB_USD_PER_HOUR")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise LabError(f"LAB_USD_PER_HOUR must be a number, got '{env}'") from None
        if not math.isfinite(value) or value < 0:
            raise LabError("LAB_USD_PER_HOUR must be a finite number >= 0")
        return value, "LAB_USD_PER_HOUR environment variable"
    if spec is not None:
        fig = spec.figure("usd_per_hour")
        if fig.value is not None:
            cite = spec.cite(fig)
            return float(fig.value), f"hardware.yaml:{spec.key} ({cite})" if cite else f"hardware.yaml:{spec.key}"
    return None, None


def cost_block(usd_per_hour: float | None, source: str | None, seconds: float, gpus: int = 1) -> dict:
    """usd = rate ($/GPU-hour) x GPUs x hours."""
    usd = usd_per_hour * gpus * seconds / 3600.0 if usd_per_hour is not None else None
    return {"usd_per_hour": usd_per_hour, "rate_source": source, "gpus": gpus,
            "seconds": round(seconds, 3), "usd": usd}
