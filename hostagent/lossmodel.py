"""Models of where packets get lost, for experiments and tests without a switch.

Pure functions: they take the packets' drop classes (and a seeded generator where chance is
involved) and return a boolean mask of the packets that survive. The transport's loss
injection and the demo use them; nothing here touches a socket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlcp.hostagent.ranges import Range

#: What :func:`congested_fifo` models: a positive offered load (multiple of the port's rate) and
#: a queue of at least one packet; ``dlcp demo`` checks its options against these.
LOAD = Range(0, lo_open=True)
CAPACITY = Range(1)
#: A drop probability (:func:`drop_by_class`, the injected losses of ``dlcp converge``).
PROBABILITY = Range(0, 1)


def drop_by_class(classes: np.ndarray, probabilities: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    """Drop each packet with the probability given for its drop class.

    Args:
        classes: drop class per packet.
        probabilities: drop probability per class; classes beyond the list are never dropped.
        rng: the source of chance (seeded by the caller, so runs repeat).

    Returns:
        bool mask, True where the packet survives.

    Example: ``drop_by_class(np.array([0, 3]), [0, 0, 0, 1.0], rng)`` -> ``[True, False]``
    """
    probs = np.asarray(probabilities, dtype=np.float64)
    if probs.size and (probs.min() < 0 or probs.max() > 1):
        raise ValueError(f"drop probabilities must be in [0, 1], got {list(probabilities)}")
    classes = np.asarray(classes, dtype=np.int64)
    p = np.zeros(classes.shape, dtype=np.float64)
    known = classes < probs.size
    p[known] = probs[classes[known]]
    return rng.random(classes.shape) >= p


def congested_fifo(
    classes: np.ndarray,
    load: float,
    capacity: int,
    thresholds: Sequence[int] | None = None,
) -> np.ndarray:
    """Which packets a congested output queue keeps, packets arriving in order.

    A fluid model of one switch port: packets arrive evenly at ``load`` times the port's
    service rate and the queue drains continuously. A packet finding ``capacity`` packets
    queued is tail-dropped. With ``thresholds`` (one per droppable class, as
    :attr:`dlcp.hostagent.policy.Policy.drop_thresholds`), a packet of class ``k >= 1`` is also
    dropped when the depth exceeds ``thresholds[k-1]``: DLCP's selective dropping. Class 0
    only ever meets the tail drop.

    Returns:
        bool mask, True where the packet was queued (and so forwarded).
    """
    if load not in LOAD or capacity not in CAPACITY:
        raise ValueError(f"need load > 0 and capacity >= 1, got load={load}, capacity={capacity}")
    limits = np.full(256, float(capacity))
    if thresholds is not None:
        limits[1 : 1 + len(thresholds)] = np.minimum(np.asarray(thresholds, dtype=float), capacity)
    classes = np.asarray(classes, dtype=np.int64)
    kept = np.zeros(classes.size, dtype=bool)
    depth = 0.0
    drain = 1.0 / load  # packets served between two arrivals
    for i, cls in enumerate(classes.tolist()):
        depth = max(0.0, depth - drain)
        if depth < capacity and depth <= limits[cls]:
            kept[i] = True
            depth += 1.0
    return kept
