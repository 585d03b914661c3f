"""Phase 2: CUDA C kernels, built with nvcc and called through ctypes. Vector add, the matmul ladder
(naive, tiled, register-blocked, mma.sync bf16) against cuBLAS in the same run, and softmax (the
seed's warp per row, then block, cluster and online kernels up to 65,536 columns, fp32 and bf16)
against torch.softmax and a copy; and the bytes that really moved, from Nsight Compute's counters
(vector add, naive and tiled matmul) against the counts predicted from the code. The modules import without a GPU or nvcc (building happens at
the first launch), so `lab list` works anywhere and CPU-only CI compiles the sources and checks the
wrappers' argument validation."""
from . import matmul, softmax, traffic, vector_add

EXERCISES = [vector_add.EXERCISE, matmul.EXERCISE, softmax.EXERCISE, traffic.EXERCISE]
