"""Phase 1: the roofline and the memory hierarchy, measured."""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("ceilings", "elementwise", "matmul_fp16", "regime_sweep", "cache_sweep", "nsight",)
