"""Phase 0: is the machine what we think it is, and do we know how to time it?"""
from .gates import EXERCISE as gates
from .matmul_baseline import EXERCISE as matmul_baseline
from .synchronize import EXERCISE as synchronize
from .timer_check import EXERCISE as timer_check

EXERCISES = [gates, matmul_baseline, synchronize, timer_check]
