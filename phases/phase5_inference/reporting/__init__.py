"""What phase 5's report.py draws on: the findings, the plots, the seed's quoted figures, and the
declarations of its two further pages (SPECULATIVE.md, TENSOR_PARALLEL.md)."""
