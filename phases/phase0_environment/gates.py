"""The four environment gates, recorded: driver, compiler, torch sees the GPU, torch version.

    lab run phase0.gates

Each gate is a row: ok, failed (something is wrong with this machine) or skipped (it does not
apply here, e.g. no driver on a CPU-only machine). The classic failure it catches is a CPU-only
torch wheel on a GPU machine: the driver answers, torch does not see the GPU.
"""
import torch

from common import env
from common.exercise import Exercise, Result, row
from common.standalone import run_alone


def gate(name: str, status: str, observed, reason=None) -> dict:
    return row(name, {}, status, reason, metrics={"observed": observed})


def run(ctx, params):
    smi = env.run_quiet(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"])
    torch_gpu = torch.cuda.is_available()
    hip = getattr(torch.version, "hip", None)              # a ROCm build: AMD's driver, no nvidia-smi
    rows = []
    if smi:
        rows.append(gate("driver", "ok", f"nvidia-smi: {smi.splitlines()[0]}"))
    elif hip and torch_gpu:
        rows.append(gate("driver", "ok", f"ROCm (HIP {hip}): torch sees {torch.cuda.get_device_name(0)}"))
    elif torch_gpu:
        rows.append(gate("driver", "failed", None, "torch sees a GPU but nvidia-smi does not answer"))
    else:
        rows.append(gate("driver", "skipped", None, "no NVIDIA driver (nvidia-smi not found): CPU-only machine"))

    nvcc = env.nvcc_version()
    if hip:
        rows.append(gate("nvcc", "skipped", None, f"a ROCm build of torch (HIP {hip}): phase 2's CUDA C does not apply"))
    else:
        rows.append(gate("nvcc", "ok", f"CUDA compiler {nvcc}") if nvcc else
                    gate("nvcc", "skipped", None, "nvcc not on PATH: phase 2's CUDA kernels cannot be built here"))

    if torch_gpu:
        rows.append(gate("torch_cuda", "ok", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"))
    elif smi:
        rows.append(gate("torch_cuda", "failed", None,
                         "the driver answers but torch.cuda.is_available() is False (a CPU-only torch build?)"))
    else:
        rows.append(gate("torch_cuda", "skipped", None, "no GPU on this machine"))

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm HIP {hip}" if hip else "CPU-only build"
    rows.append(gate("torch_version", "ok", f"torch {torch.__version__} ({build})"))
    return Result([r for r in rows if ctx.wants(r["variant"])])


EXERCISE = Exercise(id="phase0.gates", title="Environment gates: driver, nvcc, torch sees the GPU, torch version",
                    run=run, variants=("driver", "nvcc", "torch_cuda", "torch_version"))


if __name__ == "__main__":
    run_alone(EXERCISE, {})
