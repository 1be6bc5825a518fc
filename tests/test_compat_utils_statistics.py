"""Bagua's measurement helpers in ``bagua.torch_api.utils``: the outlier-free average (against
numpy's mean and std of the values the rule keeps, written out here) and the running average
over windows of 2^i seconds (against time-weighted means computed by hand, on a fake clock)."""

from __future__ import annotations

import math

import pytest

from functional_bagua.compat import utils
from functional_bagua.compat.utils import StatisticalAverage, average_by_removing_extreme_values

np = pytest.importorskip("numpy", reason="numpy computes the reference mean and std")


def test_warm_up_and_outliers_are_left_out():
    scores = [100.0, 90.0, 80.0, 10.0, 11.0, 9.0, 10.5, 9.5, 50.0]
    mean, std, kept = average_by_removing_extreme_values(scores)
    rest = np.asarray(scores[3:])  # the first third is warm-up
    expected = rest[np.abs(rest - rest.mean()) < rest.std()]  # 50 is more than one std from the mean
    assert kept == expected.tolist() and 50.0 not in kept
    assert mean == pytest.approx(expected.mean(), rel=1e-15) and std == pytest.approx(expected.std(), rel=1e-15)


def test_values_all_equal_are_kept_and_one_value_is_its_own_average():
    assert average_by_removing_extreme_values([4.0] * 6) == (4.0, 0.0, [4.0] * 4)
    assert average_by_removing_extreme_values([7]) == (7.0, 0.0, [7.0])
    with pytest.raises(ValueError, match="at least one score"):
        average_by_removing_extreme_values([])


def test_weeding_repeats_while_the_spread_exceeds_the_mean():
    scores = [0.0] * 3 + [1.0, 1.0, 1.0, 1.0, -30.0, 40.0, 1.0, 1.2]
    _, std, kept = average_by_removing_extreme_values(scores)
    assert -30.0 not in kept and 40.0 not in kept and std < np.mean(kept)


class Clock:
    def __init__(self, monkeypatch, start=1000.0):
        self.now = start
        monkeypatch.setattr(utils.time, "time", lambda: self.now)


def test_one_value_fills_every_window_it_covers(monkeypatch):
    clock = Clock(monkeypatch)
    average = StatisticalAverage()
    clock.now += 8.0
    average.record(5.0)
    assert average.records == [5.0] * 4  # windows of 1, 2, 4, 8 seconds
    assert average.record_tail == (0.0, 5.0) and average.total_recording_time() == 8.0  # a tail of 0 s
    clock.now += 3.0
    assert average.get(2.0) == 5.0 and average.get(10.0) == 5.0


def test_a_second_value_averages_by_time(monkeypatch):
    """5.0 held over 8 s, then 1.0 over 4 s: the window of 8 s is half each; the tail carries
    the 12 s average."""
    clock = Clock(monkeypatch)
    average = StatisticalAverage()
    clock.now += 8.0
    average.record(5.0)
    clock.now += 4.0
    average.record(1.0)
    assert average.records[:3] == [1.0, 1.0, 1.0]  # 1, 2, 4 s: only the new value
    assert average.records[3] == pytest.approx((1.0 * 4 + 5.0 * 4) / 8)
    seconds, mean = average.record_tail
    assert seconds == pytest.approx(12.0 - 8.0) and mean == pytest.approx((1.0 * 4 + 5.0 * 8) / 12)
    assert average.get_records_mean(6.0) == pytest.approx(1.0 + (3.0 - 1.0) * (6.0 - 4.0) / 4.0)  # between 4 s and 8 s
    assert average.get_records_mean(100.0) == pytest.approx(mean)


def test_fresh_state_and_defaults_are_per_instance(monkeypatch):
    Clock(monkeypatch, start=50.0)
    a, b = StatisticalAverage(), StatisticalAverage()
    a.records.append(1.0)
    assert b.records == [] and b.last_update_time == 50.0
    assert b.get_records_mean(3.0) == 0.0 and b.get_records_mean(-1.0) == 0.0
    assert str(b) == str({"last_update_time": 50.0, "records": [], "record_tail": (0.0, 0.0)})
    assert math.isclose(StatisticalAverage(0.0, [2.0, 4.0], (2.0, 6.0)).get_records_mean(3.0), 5.0)
