"""Phase 7: a GPT trained from scratch on TinyShakespeare: data, parameters, overfitting, a scaling
law with error bars, and failures engineered on purpose."""
from .architecture import EXERCISE as model
from .data_prep import EXERCISE as data_prep
from .failures import EXERCISE as failures
from .overfit import EXERCISE as overfit
from .scaling import EXERCISE as scaling

EXERCISES = [data_prep, model, overfit, scaling, failures]
