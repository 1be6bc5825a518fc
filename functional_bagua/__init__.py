"""functional_bagua: composable, pure optimizers for PyTorch, optax-style, with torch.optim parity.

import functional_bagua as fb

params = fb.params_of(model)
tx = fb.adamw(lr=1e-3, weight_decay=0.01)
state = tx.init(params)
updates, state = tx.update(grads, state, params)
params = fb.apply_updates(params, updates)
"""

import types as _types

from functional_bagua import foreach, schedules
from functional_bagua.aliases import (
    adabelief,
    adadelta,
    adafactor,
    adagrad,
    adam,
    adamax,
    adamw,
    asgd,
    lamb,
    lars,
    lion,
    muon,
    nadam,
    psgd_kron,
    radam,
    rmsprop,
    rprop,
    sgd,
    shampoo,
    soap,
    sparse_adam,
)
from functional_bagua.base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    chain,
    identity,
)
from functional_bagua.checkpoint import load_state_dict, state_dict
from functional_bagua.first_order import (
    ademamix,
    adopt,
    dadapt_adam,
    laprop,
    mars_adamw,
    prodigy,
    schedule_free_adamw,
    schedule_free_sgd,
)
from functional_bagua.flat import FlatLayout, FlatModule, flatten_module, flatten_parameters
from functional_bagua.fusion import fuse, fuse_inplace
from functional_bagua.hyperparams import (
    InjectHyperparamsState,
    accepts_schedules,
    inject_hyperparams,
)
from functional_bagua.lbfgs import LbfgsState, lbfgs
from functional_bagua.modules import buffers_of, load_params, params_of
from functional_bagua.optimizer import Optimizer
from functional_bagua.train_step import make_train_step
from functional_bagua.transforms import *  # noqa: F401,F403  (the building blocks)
from functional_bagua.transforms import __all__ as _transforms_all

__version__ = "0.1.0"

_SUBPACKAGES = ("distributed", "compat")


def __getattr__(name: str) -> _types.ModuleType:
    """``fb.distributed`` and ``fb.compat``, imported when first used (``functional_bagua.distributed``
    sets up torch.distributed's functional collectives, which a single-process user never needs)."""
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GradientTransformation",
    "EmptyState",
    "identity",
    "chain",
    "apply_updates",
    "params_of",
    "buffers_of",
    "load_params",
    "FlatLayout",
    "FlatModule",
    "flatten_module",
    "flatten_parameters",
    "fuse",
    "fuse_inplace",
    "make_train_step",
    "Optimizer",
    "state_dict",
    "load_state_dict",
    "schedules",
    "foreach",
    "inject_hyperparams",
    "accepts_schedules",
    "InjectHyperparamsState",
    "sgd",
    "adam",
    "adamw",
    "sparse_adam",
    "adamax",
    "nadam",
    "radam",
    "adagrad",
    "adadelta",
    "rmsprop",
    "rprop",
    "asgd",
    "adafactor",
    "muon",
    "psgd_kron",
    "shampoo",
    "soap",
    "lbfgs",
    "LbfgsState",
    "lamb",
    "lars",
    "lion",
    "adabelief",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "adopt",
    "ademamix",
    "laprop",
    "mars_adamw",
    "prodigy",
    "dadapt_adam",
    *_transforms_all,
]
