"""Bagua's ``bagua.torch_api.utils`` helpers that training scripts and tests call: tensors to one
flat buffer and back (``functional_bagua.flat.split_like`` does the cutting), grouped by
tensor type, and the checks around them."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

from functional_bagua.flat import split_like

__all__ = ["flatten", "unflatten", "apply_flattened_call"]

LOGGER = logging.getLogger(__name__)

# Bagua's names of the dtypes its communication backend takes
_BAGUA_DATATYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.int64: "i64"}


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors copied back to back into one new 1-D tensor.

    Args:
        tensors: dense tensors of one dtype and device.
    """
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (the inverse of :func:`flatten`).

    Args:
        flat: a 1-D tensor of as many elements as ``tensors`` hold.
        tensors: the tensors whose shapes the views take.
    """
    return split_like(flat, tensors)


def apply_flattened_call(
    bucket: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Optional[Sequence[Any]] = None
) -> None:
    """``call(flat, *extra_args)`` on the tensors of ``bucket`` as one flat tensor, then the result
    copied back into each tensor (e.g. an in-place collective on many tensors at once).

    Args:
        bucket: dense tensors of one dtype and device, changed in place.
        call: a function that changes its first argument in place.
        extra_args: more arguments for ``call``.
    """
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    with torch.no_grad():
        for tensor, value in zip(bucket, unflatten(flat, bucket)):
            tensor.copy_(value)


def _group_by_tensor_type(tensors: Sequence[torch.Tensor]) -> "OrderedDict[str, list[torch.Tensor]]":
    """The tensors by ``tensor.type()`` (dtype and device, e.g. ``"torch.FloatTensor"``), in the
    order each type first appears (Bagua's helper)."""
    groups: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        groups.setdefault(tensor.type(), []).append(tensor)
    return groups


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable[..., Any]) -> None:
    """:func:`apply_flattened_call` once per tensor type (Bagua's helper): tensors of mixed dtypes
    or devices each go through ``call`` as one flat tensor of their own kind.

    Args:
        tensors: dense tensors, changed in place.
        call: a function that changes its one argument in place.
    """
    for group in _group_by_tensor_type(tensors).values():
        apply_flattened_call(group, call)


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors lie back to back in memory, in order (each starts where the one before
    ends), as views into one flat buffer do (Bagua's helper)."""
    end: Optional[int] = None
    for t in tensors:
        if end is not None and t.data_ptr() != end:
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True


def get_flattened_tensor(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensors copied back to back into one new 1-D tensor, ``None`` for no tensors
    (Bagua's helper; :func:`flatten` otherwise)."""
    return flatten(tensors) if len(tensors) else None


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's name of ``datatype`` (``"f32"``, ``"f16"``, ``"u8"``, ``"i64"``); a ValueError for
    another dtype, as Bagua's."""
    if datatype not in _BAGUA_DATATYPES:
        raise ValueError(f"unsupported data type {datatype}.")
    return _BAGUA_DATATYPES[datatype]


def average_by_removing_extreme_values(raw_score_list: Sequence[float]) -> tuple[float, float, list[float]]:
    """The mean and (population) standard deviation of measurements without their warm-up and
    outliers, as Bagua's autotuner scores its trials, and the values kept::

        x = raw_score_list[len // 3:]                     # the first third is warm-up
        x = [v for v in x if |v - mean(x)| < std(x)]      # unless that leaves none
        repeated (at most 10 times more) while std(x) >= mean(x)

    Args:
        raw_score_list: the measurements, in the order they were taken (at least one).

    Returns:
        ``(mean, std, kept)``.

    Example::

        mean, std, kept = average_by_removing_extreme_values([9.0, 1.0, 1.1, 0.9, 1.0, 50.0])
    """
    scores = [float(v) for v in raw_score_list]
    if not scores:
        raise ValueError("average_by_removing_extreme_values needs at least one score")
    scores = scores[len(scores) // 3 :]
    scores = _without_outliers(scores)
    for _ in range(10):
        if statistics.pstdev(scores) < statistics.fmean(scores):
            break
        scores = _without_outliers(scores)
    return statistics.fmean(scores), statistics.pstdev(scores), scores


def _without_outliers(scores: list[float]) -> list[float]:
    """The scores less than one standard deviation from their mean; all of them if none is."""
    mean, std = statistics.fmean(scores), statistics.pstdev(scores)
    kept = [v for v in scores if abs(v - mean) < std]
    return kept or scores


class StatisticalAverage:
    """A running average of a value over windows of the last ``2 ** i`` seconds, as Bagua's
    autotuner keeps its speed measurements.

    ``records[i]`` is the value's average over the ``2 ** i`` seconds before ``last_update_time``;
    ``record_tail = (seconds, mean)`` its average over the ``seconds`` before those. A value
    recorded ``d`` seconds after the last holds for those ``d`` seconds::

        records'[i] = value                                         if 2^i <= d
                    = value * d / 2^i + mean(2^i - d) * (1 - d / 2^i)   if 2^i <= d + covered
        tail'       = (d + covered - 2^(last i), value * d / (d + covered) + mean(covered) * (1 - ...))

    where ``mean(s)`` is the average over the ``s`` seconds before the last record (linear between
    the windows), and ``covered`` the seconds recorded before.

    Args:
        last_update_time: when the last value was recorded (``time.time()``; now by default).
        records: the windows' averages (none by default).
        record_tail: ``(seconds, mean)`` beyond the windows.

    Example::

        speed = StatisticalAverage()
        speed.record(120.0)          # samples per second, measured now
        speed.get(last_n_seconds=10)
    """

    def __init__(
        self,
        last_update_time: Optional[float] = None,
        records: Optional[list[float]] = None,
        record_tail: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.last_update_time: float = time.time() if last_update_time is None else last_update_time
        self.records: list[float] = list(records) if records is not None else []
        self.record_tail: tuple[float, float] = record_tail

    def record_seconds(self) -> float:
        """The seconds the windows cover: ``2 ** (len(records) - 1)``, or 0 without records."""
        return 2.0 ** (len(self.records) - 1) if self.records else 0.0

    def total_recording_time(self) -> float:
        """The seconds covered, the windows' and the tail's."""
        return self.record_seconds() + self.record_tail[0]

    def get_records_mean(self, last_n_seconds: float) -> float:
        """The average over the ``last_n_seconds`` before the last record (linear between windows,
        the tail's mean beyond them).

        Args:
            last_n_seconds: the window, in seconds.
        """
        if last_n_seconds <= 0.0:
            return 0.0
        tail_seconds, tail_mean = self.record_tail
        if not self.records:
            return tail_mean
        if last_n_seconds < 1.0:
            return self.records[0]
        covered = self.record_seconds()
        if last_n_seconds <= covered:
            below = max(0, math.floor(math.log2(last_n_seconds)))
            if below + 1 >= len(self.records):
                return self.records[below]
            return _between(
                2.0**below, self.records[below], 2.0 ** (below + 1), self.records[below + 1], last_n_seconds
            )
        if last_n_seconds <= covered + tail_seconds:
            return _between(covered, self.records[-1], covered + tail_seconds, tail_mean, last_n_seconds)
        return tail_mean

    def record(self, val: float) -> None:
        """Record the value measured now.

        Args:
            val: the value.
        """
        now = time.time()
        since = now - self.last_update_time
        covered = self.total_recording_time()
        records: list[float] = []
        tail = (0.0, 0.0)
        for i in range(64):
            window = 2.0**i
            if window <= since:
                records.append(val)
            elif window <= since + covered:
                share = since / window
                records.append(val * share + self.get_records_mean(window - since) * (1.0 - share))
            else:
                share = since / (since + covered)
                windows = 2.0 ** (len(records) - 1) if records else 0.0
                tail = (since + covered - windows, val * share + self.get_records_mean(covered) * (1.0 - share))
                break
        self.last_update_time, self.records, self.record_tail = now, records, tail

    def get(self, last_n_seconds: float) -> float:
        """The average over the last ``last_n_seconds`` (the last value, where none was recorded
        in them).

        Args:
            last_n_seconds: the window, in seconds.
        """
        since = time.time() - self.last_update_time
        if last_n_seconds <= since:
            return self.records[0] if self.records else self.record_tail[1]
        return self.get_records_mean(last_n_seconds - since)

    def __str__(self) -> str:
        return str(
            {"last_update_time": self.last_update_time, "records": self.records, "record_tail": self.record_tail}
        )


def _between(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    """The line through ``(x0, y0)`` and ``(x1, y1)`` at ``x``."""
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
