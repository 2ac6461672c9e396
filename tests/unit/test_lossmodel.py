"""Loss models used by the demo and by the transport's loss injection."""

import numpy as np
import pytest

from dlcp.hostagent.lossmodel import congested_fifo, drop_by_class


def test_drop_by_class_respects_probabilities():
    rng = np.random.default_rng(0)
    classes = np.repeat(np.arange(4), 10_000)
    kept = drop_by_class(classes, [0.0, 0.1, 0.5, 1.0], rng)
    rates = [1 - kept[classes == c].mean() for c in range(4)]
    assert rates[0] == 0.0 and rates[3] == 1.0
    assert rates[1] == pytest.approx(0.1, abs=0.02) and rates[2] == pytest.approx(0.5, abs=0.02)
    assert drop_by_class(np.array([5]), [1.0], rng).tolist() == [True]  # class without a probability
    with pytest.raises(ValueError):
        drop_by_class(classes, [1.5], rng)


def test_fifo_below_capacity_loses_nothing():
    assert congested_fifo(np.zeros(1000, int), load=0.9, capacity=8).all()


def test_fifo_overload_loses_the_excess():
    kept = congested_fifo(np.zeros(100_000, int), load=1.25, capacity=64)
    assert 1 - kept.mean() == pytest.approx(0.2, abs=0.01)


def test_selective_thresholds_spare_class_0():
    rng = np.random.default_rng(1)
    classes = rng.integers(0, 4, 20_000)
    kept = congested_fifo(classes, load=1.25, capacity=64, thresholds=(48, 32, 16))
    dropped = np.bincount(classes[~kept], minlength=4)
    assert dropped[0] == 0 and dropped[3] > 0
    # the least important class absorbs the most
    assert dropped[3] >= dropped[2] >= dropped[1]
