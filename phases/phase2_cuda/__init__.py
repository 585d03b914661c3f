"""Phase 2: CUDA C kernels, built with nvcc and called through ctypes: vector add, the matmul ladder
against cuBLAS, softmax against torch.softmax and a copy, and the bytes that really moved (Nsight
Compute). The modules import without a GPU or nvcc (building happens at the first launch), so
`lab list` works anywhere and CPU-only CI compiles the sources and checks the wrappers' argument
validation. report.py (the README's blocks) imports only the torch-free rungs.py and analysis.py."""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("vector_add", "matmul", "softmax", "traffic",)
