"""Bagua's autotuning service, answered in process at Bagua's level 0 (no tuning).

Bagua ran an HTTP service on rank 0 that suggested how to bucket each model's tensors and, at
``BAGUA_AUTOTUNE`` level 1 and above, tuned the bucket size from the speeds the ranks reported.
Here there is no service and no tuning: :class:`AutotuneService` answers as Bagua's does at level
0, with the tensors in their registered order cut into buckets of ``default_bucket_size`` bytes,
one dtype per bucket (:func:`in_order_buckets`; Bagua's sorted them by dtype name first), tuning
reported complete; and
:class:`AutotuneClient`, Bagua's client, asks this process's service directly. Every rank
computes the same buckets from the same tensors, as all asked the one service in Bagua.

``start_autotune_server`` makes this process's service; ``run_flask_app`` (the HTTP server
itself) raises a NotImplementedError, as no HTTP service runs here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from functional_bagua.compat.utils import _BAGUA_DATATYPES
from functional_bagua.distributed.buckets import assign_buckets

__all__ = ["AutotuneClient", "AutotuneService", "Response", "run_flask_app", "start_autotune_server"]


class Response:
    """What the client's calls return, as Bagua's HTTP responses read: ``status_code`` and ``json()``.

    Args:
        body: the answer.
    """

    status_code = 200

    def __init__(self, body: Any = None) -> None:
        self.body = body

    def json(self) -> Any:
        """The answer."""
        return self.body


class AutotuneService:
    """Bucket suggestions at level 0 (module docstring; Bagua's signature).

    Args:
        world_size: the number of ranks.
        autotune_level: 0 (any other level raises a ValueError: nothing is tuned here).
        max_samples: Bagua's tuning budget (unused at level 0).
        sampling_confidence_time_s: Bagua's tuning setting (unused at level 0).
        warmup_time_s: Bagua's tuning setting (unused at level 0).
        is_output_autotune_log: Bagua's tuning setting (unused at level 0).
        default_bucket_size: the bucket size in bytes.
    """

    def __init__(
        self,
        world_size: int,
        autotune_level: int = 0,
        max_samples: int = 60,
        sampling_confidence_time_s: float = 5,
        warmup_time_s: float = 30,
        is_output_autotune_log: bool = False,
        default_bucket_size: int = 10 * 1024**2,
    ) -> None:
        if autotune_level != 0:
            raise ValueError(
                f"AutotuneService: autotune_level={autotune_level}: this layer does not tune bucket sizes "
                "(level 0 only); set the size with with_bagua's bucket_cap_mb or BAGUA_DEFAULT_BUCKET_SIZE"
            )
        if not default_bucket_size > 0:
            raise ValueError(f"AutotuneService: default_bucket_size must be positive, got {default_bucket_size}")
        self.world_size, self.autotune_level, self.default_bucket_size = world_size, autotune_level, default_bucket_size
        self.max_samples, self.sampling_confidence_time_s = max_samples, sampling_confidence_time_s
        self.warmup_time_s, self.is_output_autotune_log = warmup_time_s, is_output_autotune_log
        self.tensors: dict[str, list] = {}  # model name -> its tensor declarations, in order
        self.bucketing: dict[str, bool] = {}

    def register_tensors(self, model_name: str, tensor_list: list, whether_to_bucket: bool = True) -> dict:
        """Record a model's tensors: declarations ``{"name", "num_elements", "dtype"}``, in order.

        Args:
            model_name: the model's ``bagua_module_name``.
            tensor_list: the declarations.
            whether_to_bucket: cut them into buckets (``False``: one bucket per dtype, as Bagua's
                10 PiB bucket size gives).
        """
        for declaration in tensor_list:
            if declaration["dtype"] not in _BAGUA_DATATYPES.values():
                raise ValueError(f"tensor {declaration['name']!r}: unknown dtype {declaration['dtype']!r}")
        self.tensors[model_name] = list(tensor_list)
        self.bucketing[model_name] = whether_to_bucket
        return {"status": "ok"}

    def ask_hyperparameters(self, model_name: str, rank: int, train_iter: int) -> dict:
        """The suggestion for ``model_name``: its buckets (lists of declarations), tuning complete.

        Args:
            model_name: a model registered with :meth:`register_tensors`.
            rank: the asking rank (every rank gets the same answer).
            train_iter: the asking rank's step.
        """
        if model_name not in self.tensors:
            raise KeyError(f"AutotuneService: no tensors registered for model {model_name!r} (register_tensors first)")
        bucket_bytes = self.default_bucket_size if self.bucketing[model_name] else UNBOUNDED_BUCKET_BYTES
        buckets = _cut(self.tensors[model_name], bucket_bytes)
        return {
            "recommended_hyperparameters": {"buckets": buckets, "is_hierarchical_reduce": False},
            "is_autotune_completed": True,
        }

    def report_metrics(self, model_name: str, rank: int, train_iter: int, hyperparameters: dict, speed: float) -> dict:
        """Accept a rank's speed report (nothing is tuned from it at level 0).

        Args:
            model_name: the model.
            rank: the reporting rank.
            train_iter: its step.
            hyperparameters: the hyperparameters it ran with.
            speed: its measured speed.
        """
        return {"status": "ok"}

    def report_tensor_execution_order(self, spans: list) -> dict:
        """Accept Bagua's trace of when tensors became ready (unused at level 0).

        Args:
            spans: the trace.
        """
        return {"status": "ok"}


def in_order_buckets(tensors: list, bucket_bytes: float) -> list[list[int]]:
    """The indices of ``tensors`` in each bucket: the tensors in their order, by dtype and device,
    a bucket closed once it reaches ``bucket_bytes`` (the rule of
    :func:`functional_bagua.distributed.assign_buckets`, which fills from the last tensor).

    Args:
        tensors: tensors (or meta tensors standing for them).
        bucket_bytes: the bucket size in bytes.
    """
    n = len(tensors)
    backwards = list(reversed(tensors))
    return [[n - 1 - i for i in group] for group in assign_buckets(backwards, max(1, int(bucket_bytes)))]


def _cut(declarations: list, bucket_bytes: int) -> list[list]:
    """The declarations cut by :func:`in_order_buckets`."""
    dtypes = {name: dtype for dtype, name in _BAGUA_DATATYPES.items()}
    standing = [torch.empty(d["num_elements"], dtype=dtypes[d["dtype"]], device="meta") for d in declarations]
    return [[declarations[i] for i in group] for group in in_order_buckets(standing, bucket_bytes)]


UNBOUNDED_BUCKET_BYTES = 10 * 1024**5  # Bagua's size for "do not bucket"

_service: Optional[AutotuneService] = None


def service() -> AutotuneService:
    """This process's service (made with Bagua's environment's settings on first use)."""
    global _service
    if _service is None:
        from functional_bagua.compat.communication import get_default_bucket_size, get_world_size

        _service = AutotuneService(world_size=get_world_size(), default_bucket_size=get_default_bucket_size())
    return _service


class AutotuneClient:
    """Bagua's client of the service, answered by this process's (module docstring).

    Args:
        service_addr: the service's host (kept; nothing is contacted).
        service_port: the service's port (kept; nothing is contacted).
        proxies: kept for Bagua's signature.
    """

    def __init__(self, service_addr: str, service_port: Optional[int], proxies: Optional[dict] = None) -> None:
        self.autotune_service_addr = f"{service_addr}:{service_port}"
        self.proxies = proxies

    def register_tensors(self, model_name: str, tensor_list: list, whether_to_bucket: bool = True) -> Response:
        """:meth:`AutotuneService.register_tensors`.

        Args:
            model_name: the model's ``bagua_module_name``.
            tensor_list: the declarations.
            whether_to_bucket: cut them into buckets.
        """
        return Response(service().register_tensors(model_name, tensor_list, whether_to_bucket))

    def ask_hyperparameters(self, model_name: str, rank: int, train_iter: int) -> Response:
        """:meth:`AutotuneService.ask_hyperparameters`.

        Args:
            model_name: a registered model.
            rank: the asking rank.
            train_iter: its step.
        """
        return Response(service().ask_hyperparameters(model_name, rank, train_iter))

    def report_metrics(
        self, model_name: str, rank: int, train_iter: int, hyperparameters: dict, speed: float
    ) -> Response:
        """:meth:`AutotuneService.report_metrics`.

        Args:
            model_name: the model.
            rank: the reporting rank.
            train_iter: its step.
            hyperparameters: the hyperparameters it ran with.
            speed: its measured speed.
        """
        return Response(service().report_metrics(model_name, rank, train_iter, hyperparameters, speed))

    def report_tensor_execution_order(self, spans: list) -> Response:
        """:meth:`AutotuneService.report_tensor_execution_order`.

        Args:
            spans: the trace.
        """
        return Response(service().report_tensor_execution_order(spans))

    def health_check(self) -> bool:
        """Whether the service answers (this process's always does)."""
        return True


def start_autotune_server(service_port: int) -> None:
    """Make this process's service (Bagua started its HTTP server in a process of its own).

    Args:
        service_port: Bagua's port (kept: ``communication._autotune_service_port``).
    """
    from functional_bagua.compat import communication

    communication._autotune_server = service()
    communication._autotune_service_port = service_port


def run_flask_app(port: int) -> None:
    """Bagua's HTTP server of the service, which does not run here (a NotImplementedError).

    Args:
        port: the port it would listen on.
    """
    raise NotImplementedError(
        "run_flask_app: no HTTP autotuning service runs here; AutotuneClient and "
        "get_hyperparameters_service_client() answer in this process (functional_bagua.compat.autotune)"
    )
