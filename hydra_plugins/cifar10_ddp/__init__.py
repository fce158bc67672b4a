"""The project's Hydra sweepers. Hydra instantiates sweepers only from the ``hydra_plugins`` namespace, so the
classes that conf/hydra/sweeper/*.yaml name live here; what they do lives in src/sweeps/sweep.py and
src/sweeps/hparams_search.py."""

from src.sweeps.hparams_search import OptunaSweeper as _OptunaSweeper
from src.sweeps.sweep import ResumingSweeper as _ResumingSweeper


class ResumingSweeper(_ResumingSweeper):
    """Hydra's basic sweeper; run again with the same hydra.sweep.dir, it skips the jobs that finished."""


class OptunaSweeper(_OptunaSweeper):
    """An Optuna study whose trials are whole training runs (hparams_search=optuna)."""
