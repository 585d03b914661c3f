"""JAX beside torch in one process: which device JAX found, whether torch's rows can stand beside
its rows (the same device), moving the same inputs across, and the roofs JAX's rows are held to.

XLA preallocates most of a GPU's memory the first time JAX touches it, which would starve torch
in the same process; XLA_PYTHON_CLIENT_PREALLOCATE=false (set here, before anything imports jax)
makes it allocate as it goes. jax is imported only when an exercise runs, never by `lab list`.
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from common import roofline  # noqa: E402
from common.errors import Skip  # noqa: E402
from common.hardware import load_hardware, match_gpu  # noqa: E402
from common.paths import scrub_paths  # noqa: E402

FUNCTIONAL = "JAX returns a new array (no output buffer to poison): the check compares that array"


def load():
    """The jax module, or Skip (with how to get it) when it is not installed or will not start."""
    try:
        import jax
        jax.devices()
    except ImportError:
        raise Skip("needs the Python package `jax`; not installed (pip install jax; jax[cuda13] on an NVIDIA GPU)") from None
    except RuntimeError as exc:
        raise Skip(f"jax could not start a backend: {why(exc)}") from None
    return jax


def why(exc: BaseException, limit: int = 200) -> str:
    """An exception as one line for a record: its type and first line, without absolute paths."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return scrub_paths(f"{type(exc).__name__}: {lines[0][:limit].rstrip('.') if lines else 'no message'}")


def device():
    return load().devices()[0]


def describe(dev) -> dict:
    """What a record says about where JAX ran."""
    import jax
    return {"jax": jax.__version__, "jax_platform": dev.platform, "jax_device": dev.device_kind,
            "jax_backend": jax.default_backend()}


def mismatch(ctx, dev) -> str | None:
    """Why torch's rows cannot be compared with JAX's on one device (None: they can)."""
    torch_side = "gpu" if ctx.is_cuda else "cpu"
    if dev.platform == torch_side:
        return None
    if ctx.is_cuda:
        return (f"JAX found no GPU (its backend is {dev.platform}): install the CUDA build of jax "
                "(jax[cuda13]) to run it beside torch on this GPU")
    return f"JAX runs on a {dev.platform} ({dev.device_kind}) and torch on the CPU: no same-device comparison"


def spec_of(ctx, dev):
    """The hardware.yaml entry JAX's device is held to: the run's own where JAX shares torch's
    device, else the entry whose `match` hits JAX's device_kind (a TPU); Skip if none does."""
    if mismatch(ctx, dev) is None:
        return ctx.spec
    spec = match_gpu(dev.device_kind, load_hardware())
    if spec is None:
        raise Skip(f"JAX runs on '{dev.device_kind}', which no hardware.yaml entry matches: add one (see its header)")
    return spec


def predict(ctx, dev, flops: float, nbytes: float, dtype: str, timing, launches: int = 1) -> dict:
    """The row's prediction: the run's own (spec and calibrated) where JAX shares torch's device,
    else the spec-sheet roofline of JAX's device from hardware.yaml."""
    if mismatch(ctx, dev) is None:
        return ctx.predict(flops, nbytes, dtype, timing, launches=launches)
    from .architectures import roofs
    out = roofline.predict(flops, nbytes, roofs(spec_of(ctx, dev)), dtype, timing.median_ms)
    return {**out, "launches": launches}


def roofs_for(ctx, dev, dtype: str) -> roofline.Roofs:
    if mismatch(ctx, dev) is None:
        return ctx.roofs(dtype)
    from .architectures import roofs
    return roofs(spec_of(ctx, dev))


def to_jax(tensor, dev):
    """A torch tensor's values as a JAX array of the same dtype on `dev` (through the host: the
    inputs are made once, so the copy costs nothing that is timed)."""
    import jax
    import jax.numpy as jnp
    import torch
    dtypes = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16, torch.float32: jnp.float32}
    return jax.device_put(tensor.detach().float().cpu().numpy().astype(dtypes[tensor.dtype]), dev)


def to_torch(array, device):
    """A JAX array as a float32 torch tensor on `device`, for the check."""
    import numpy as np
    import torch
    return torch.from_numpy(np.asarray(array).astype(np.float32)).to(device)
