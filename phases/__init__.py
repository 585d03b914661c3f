"""One package per phase; each lists its exercises in EXERCISES."""
