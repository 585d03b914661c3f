"""Phase 2: CUDA C kernels, built with nvcc and called through ctypes. Vector add, then the matmul
ladder (naive, tiled, register-blocked, mma.sync bf16) against cuBLAS in the same run. The modules
import without a GPU or nvcc (building happens at the first launch), so `lab list` works anywhere
and CPU-only CI compiles the sources and checks the wrappers' argument validation."""
from . import matmul, vector_add

EXERCISES = [vector_add.EXERCISE, matmul.EXERCISE]
