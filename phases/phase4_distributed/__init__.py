"""Phase 4: distributed primitives. DDP, a ring all-reduce from scratch, the interconnect measured.

Every exercise starts its own ranks with torchrun (launch.py), NCCL on GPUs, or gloo on CPU
processes when asked (--param backend=gloo). See README.md.
"""

# One module per exercise, named after its id; the registry imports them (the report does not).
# link_ceilings first: the alpha-beta constants the sweep and the ring are predicted from (calibration.py).
EXERCISE_MODULES = ("link_ceilings", "ddp", "ring_allreduce", "interconnect",)
