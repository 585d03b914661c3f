"""One package per phase; each names its exercise modules in EXERCISE_MODULES."""
