"""Phase 0: is the machine what we think it is, and do we know how to time it?"""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("gates", "matmul_baseline", "synchronize", "timer_check",)
