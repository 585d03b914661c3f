"""The model phase 5's "8B" goals, findings, briefs and plots speak of. A run with `--param
model=...` adds another model's rows to the same exercise; the full tables keep them (a model
column), everything that names the 8B reads only its rows."""
GOAL_MODEL = "llama-3.1-8b"


def of_8b(rows):
    """The rows of `rows` (a frame of report rows) measured on the 8B shape; none without a model column."""
    return rows[rows["params.model"] == GOAL_MODEL] if "params.model" in rows else rows.iloc[0:0]
