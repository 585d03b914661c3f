"""Phase 5's roofline predictions, torch-free: what a decode step, a prefill, a serving run and a
quantized matmul should cost. Exercises record them; `lab predict` and the report read them."""
