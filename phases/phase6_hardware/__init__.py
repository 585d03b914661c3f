"""Phase 6: alternative hardware. JAX and XLA on whatever backend JAX finds (fusion read from the
compiled HLO), Groq's LPU through its API with phase 5's streaming method, and every accelerator in
hardware.yaml on one roofline, measured and quoted points beside the prediction."""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("jax_matmul", "jax_attention", "groq_api",)
