"""Compile every candidate config of every phase-3 kernel for a GPU this machine may not have.

    python -m phases.phase3_triton.compile_check [--arch 90] [--only matmul]

No GPU is needed: the wrappers are called with CPU tensors inside `common.triton_shim.compile_only`, so each
launch compiles for sm_<arch> and returns. For every kernel it prints the shared memory the config
asks for (Hopper allows 227 KiB per block), and ptxas's registers per thread and spill bytes: a
spilling or over-budget config is one the autotuner will drop or that will run slowly, and it is
cheaper to learn that here than on a rented GPU. CI runs a subset of it (tests/test_phase3_*).
"""
import argparse
import re
import subprocess
import sys
import tempfile

import torch

SMEM_LIMIT_BYTES = 227 * 1024                       # Hopper: max dynamic shared memory per block


def ptxas_report(compiled, arch: int) -> dict:
    """Registers per thread and spill bytes, from ptxas -v on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    return {"registers": int(regs[-1]) if regs else None, "spill_bytes": max(spills) if spills else None,
            "ptxas_ok": out.returncode == 0}


def cases(only: str | None = None, quick: bool = False):
    """(name, thunk) pairs; each thunk calls a wrapper once with CPU tensors of benchmark shape.
    quick: the first config of each list (and the first warp-specialized one), for CI."""
    first = (lambda xs: xs[:1]) if quick else (lambda xs: xs)
    from . import matmul as mm
    from . import softmax as sm
    from . import vector_add as va
    e = torch.empty
    out = []
    if only in (None, "vector_add"):
        x = e(2**24)
        out += [(f"vector_add {va.label(c)}", lambda c=c: va.add(x, x, x, c)) for c in first(va.CONFIGS)]
    if only in (None, "softmax"):
        for n in ((2048, 65536) if quick else (2048, 16384, 65536)):
            x = e(2**27 // n, n)
            out += [(f"softmax cols={n} {sm.label(c)}", lambda c=c, x=x: sm.softmax(x, x, c)) for c in first(sm.candidates(n))]
    if only in (None, "matmul"):
        # odd N: triton_tma pads B and stores C through pointers (its C_TMA=False epilogue)
        for m, n, k in ((8192, 8192, 8192), (13, 4097, 14336)) if quick else \
                ((8192, 8192, 8192), (1024, 1024, 1024), (13, 4096, 14336), (13, 4097, 14336), (64, 8192, 8192),
                 (5000, 6000, 4104), (4001, 5003, 4104)):
            a, b, c_ = e(m, k, dtype=torch.bfloat16), e(k, n, dtype=torch.bfloat16), e(m, n, dtype=torch.bfloat16)
            for tma, impl in ((False, mm.matmul), (True, mm.matmul_tma)):
                cands = mm.candidates(m, n, k, 2, 132, tma=tma)
                cands = cands[:1] + [c for c in cands[1:] if c.get("ws")][:1] if quick else cands
                out += [(f"{impl.__name__} {m}x{n}x{k} {mm.label(c)}", lambda c=c, a=a, b=b, c_=c_, impl=impl:
                         impl(a, b, c_, c)) for c in cands]
    if only in (None, "flash_attention"):
        from . import flash_attention as fa
        for dt in (torch.bfloat16, torch.float32):
            for d in (((128,) if quick else (64, 128)) if dt != torch.float32 else (64,)):
                q = e(16384 // 4096, 2048 // d, 4096, d, dtype=dt)
                cands = fa.forward_candidates(dt, d, causal=False, warp_specialize=True, n=4096)
                cands = first([c for c in cands if not c["ws"]]) + first([c for c in cands if c["ws"]]) if quick else cands
                for c in cands:
                    out.append((f"attn fwd {dt} d={d} {fa.label(c)}",
                                lambda c=c, q=q: fa.attention_forward(q, q, q, causal=False, config=c)))
        for d in ((128,) if quick else (64, 128)):
            q = e(4, 2048 // d, 4096, d, dtype=torch.bfloat16)
            lse = e(4, 2048 // d, 4096)
            for c in first(fa.backward_candidates(torch.bfloat16, d)):
                out.append((f"attn bwd bf16 d={d} {fa.label(c)}",
                            lambda c=c, q=q, lse=lse: fa.attention_backward(q, q, q, q, lse, q, causal=True, config=c)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--only", choices=["vector_add", "softmax", "matmul", "flash_attention"])
    p.add_argument("--quick", action="store_true", help="one config per kernel (what CI compiles)")
    args = p.parse_args(argv)
    from common.triton_shim import compile_only
    bad = 0
    for name, thunk in cases(args.only, args.quick):
        with compile_only(args.arch) as cc:
            try:
                thunk()
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"FAIL  {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}")
                bad += 1
                continue
        for kernel, compiled in cc.built:
            rep = ptxas_report(compiled, args.arch)
            smem = compiled.metadata.shared
            flag = "ok  " if smem <= SMEM_LIMIT_BYTES and not rep["spill_bytes"] and rep["ptxas_ok"] else "WARN"
            bad += flag != "ok  "
            print(f"{flag}  {name} [{kernel}]: {compiled.metadata.num_warps} warps, shared {smem / 1024:.0f} KiB, "
                  f"{rep['registers']} registers, spills {rep['spill_bytes']} B")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
