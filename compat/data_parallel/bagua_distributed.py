"""Bagua's ``bagua.torch_api.data_parallel.bagua_distributed``: the data-parallel engine
(:class:`~functional_bagua.compat.bagua_module.BaguaDistributedDataParallel`, which ``with_bagua``
makes) under Bagua's module path, with the names that module imports and the definitions it
takes from Bagua's ``bagua_define`` (:class:`TensorDeclaration`, :class:`BaguaHyperparameter`)
and its MoE utilities (:func:`is_moe_param`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

import torch

from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel
from functional_bagua.compat.communication import (  # noqa: F401  # Bagua's module exports them
    BaguaProcessGroup,
    broadcast,
    get_backend,
    get_hyperparameters_service_client,
)
from functional_bagua.compat.utils import StatisticalAverage, to_bagua_datatype

__all__ = [
    "BaguaDistributedDataParallel",
    "BaguaHyperparameter",
    "BaguaProcessGroup",
    "StatisticalAverage",
    "TensorDeclaration",
    "broadcast",
    "is_moe_param",
    "to_bagua_datatype",
]


class TensorDeclaration(TypedDict):
    """A tensor as Bagua's autotuner sees it: its name, number of elements and dtype name
    (:func:`~functional_bagua.compat.utils.to_bagua_datatype`: ``"f32"``, ``"f16"``, ``"u8"``, ``"i64"``)."""

    name: str
    num_elements: int
    dtype: str


@dataclasses.dataclass
class BaguaHyperparameter:
    """The communication settings Bagua's autotuner chooses: the buckets (lists of tensor
    declarations), the bucket size in bytes and whether reductions are hierarchical.

    Args:
        buckets: the tensors of each bucket.
        bucket_size: the bucket size, bytes.
        is_hierarchical_reduce: reduce within each node first, then across nodes.

    Example::

        settings = BaguaHyperparameter().update({"bucket_size": 10 << 20})
    """

    buckets: list[list[TensorDeclaration]] = dataclasses.field(default_factory=list)
    bucket_size: int = 0
    is_hierarchical_reduce: bool = False

    def update(self, param_dict: dict[str, Any]) -> BaguaHyperparameter:
        """Set the known settings of ``param_dict`` (others are ignored, as Bagua's) and return self.

        Args:
            param_dict: ``{setting: value}``.
        """
        for key, value in param_dict.items():
            if key in {f.name for f in dataclasses.fields(self)}:
                setattr(self, key, value)
        return self

    def dict(self) -> dict[str, Any]:
        """The settings as a dict (as Bagua's pydantic model gives them)."""
        return dataclasses.asdict(self)


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a mixture-of-experts expert (its ``expert`` attribute is set
    and true, as Bagua's MoE layers mark their parameters).

    Args:
        param: a parameter.
    """
    return bool(getattr(param, "expert", False))
