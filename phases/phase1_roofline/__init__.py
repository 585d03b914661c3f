"""Phase 1: the roofline and the memory hierarchy, measured."""
from .cache_sweep import EXERCISE as cache_sweep
from .elementwise import EXERCISE as elementwise
from .matmul import ANCHOR as matmul_fp16, SWEEP as regime_sweep
from .nsight import EXERCISE as nsight

EXERCISES = [elementwise, matmul_fp16, regime_sweep, cache_sweep, nsight]
