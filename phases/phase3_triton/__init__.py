"""Phase 3: Triton kernels. Vector add, fused softmax, matmul and flash attention (forward and
backward), each checked against a reference and timed against the best library path in the
same run. The modules import without Triton installed (see common/triton_shim.py), so `lab list` works anywhere."""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("vector_add", "softmax", "matmul", "flash_attention", "flash_attention_bwd",)
