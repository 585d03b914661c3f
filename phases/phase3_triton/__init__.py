"""Phase 3: Triton kernels. Vector add, fused softmax, matmul and flash attention (forward and
backward), each checked against a reference and timed against the best library path in the
same run. The modules import without Triton installed (see _support), so `lab list` works anywhere."""
from . import flash_attention, flash_attention_bwd, matmul, softmax, vector_add

EXERCISES = [vector_add.EXERCISE, softmax.EXERCISE, matmul.EXERCISE, flash_attention.EXERCISE,
             flash_attention_bwd.EXERCISE]
