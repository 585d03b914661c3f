"""What phase 2's report and its findings both read: the exercise ids and how a softmax row is named.

Its own module so that report.py (which declares the findings block) and findings.py (which
writes it) import it without importing each other.
"""
MM, VA, SM, TR = "phase2.matmul", "phase2.vector_add", "phase2.softmax", "phase2.traffic"


def row_length(r) -> str:
    """A softmax row's dtype and length, as goals and findings name it: 'fp32, 65,536 columns'."""
    return f"{r['params.dtype']}, {int(r['params.cols']):,} columns"
