"""Phase 7: a GPT trained from scratch on TinyShakespeare: data, parameters, overfitting, a scaling
law with error bars, and failures engineered on purpose."""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("data_prep", "model", "overfit", "scaling", "failures",)
