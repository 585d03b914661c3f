"""Phase 4: distributed primitives. DDP, a ring all-reduce from scratch, the interconnect measured.

Every exercise starts its own ranks with torchrun (launch.py), NCCL on GPUs, or gloo on CPU
processes when asked (--param backend=gloo). See README.md.
"""
from . import ddp as _ddp, ring as _ring, sweep as _sweep

EXERCISES = [_ddp.EXERCISE, _ring.EXERCISE, _sweep.EXERCISE]
