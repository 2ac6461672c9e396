"""The compiled data path's configuration, from each fact's one definition: what
:class:`~dlcp.hostagent.datapath.native.NativeDatapath` and
:class:`~dlcp.hostagent.datapath.offline.Placement` hand the extension (``_datapath.Datapath``).

Its own module so that both can import it without importing each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlcp.hostagent import wire
from dlcp.hostagent.datapath.credits import (CREDIT_QUIET, CREDIT_SHARE, CREDIT_TIMEOUT, MIN_WINDOW, initial_window,
                                             max_datagram)
from dlcp.hostagent.policy import CLASS_SAMPLE, PARALLEL_MAGNITUDE_ELEMS, SAMPLED_CLASSES_PACKETS, magnitude_threads
from dlcp.hostagent.protocol.incoming import (ANSWER_GAPS, FRESH_KEPT, FRESH_WINDOW, MAX_ANSWER_GRACE, MAX_BUSY_DEFER,
                                              REORDER_DECAY, REORDER_MARGIN, REORDER_MIN, REORDER_PERSIST)
from dlcp.hostagent.ratecontrol import BEHIND_BACKLOG, DRAIN_FRESH, DRAIN_MIN_BYTES, DRAIN_STRETCH
from dlcp.hostagent.transport_config import TransportConfig

#: Element kinds of the compiled path, by wire dtype code.
KINDS = {int(wire.Dtype.FLOAT32): 0, int(wire.Dtype.FLOAT16): 1, int(wire.Dtype.BFLOAT16): 2}
BFLOAT16 = wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]
#: Longest the send thread sleeps for one run's pacing (one GSO call's worth).
MAX_INLINE_WAIT = 0.0005
def _raw(a: np.ndarray) -> np.ndarray:
    """``a`` as the extension can take it: a bfloat16 array (ml_dtypes' type, which nanobind does
    not know) as its uint16 bits, the same memory; the element type goes by its wire code."""
    return a.view(np.uint16) if a.dtype == BFLOAT16 else a


def native_config(config: TransportConfig, fd: int, gro: bool) -> dict[str, Any]:
    """The extension's configuration for an endpoint, every value from its one definition."""
    pol, loss = config.policy, config.loss
    return {
        "header_size": wire.HEADER_SIZE,
        "header_fields": {name: (off, wire.FIELD_DTYPE[name].itemsize) for name, off in wire.FIELD_OFFSET.items()},
        "version": wire.VERSION, "data_ptype": int(wire.PacketType.DATA),
        "credit_ptype": int(wire.PacketType.CREDIT), "stop_ptype": int(wire.PacketType.STOP),
        "initial_window": initial_window(config),
        "credit_timeout": CREDIT_TIMEOUT, "credit_quiet": CREDIT_QUIET, "credit_share": CREDIT_SHARE,
        "min_window": MIN_WINDOW, "max_window": wire.MAX_CREDIT_WINDOW,
        "flag_retx": int(wire.Flags.RETX), "flag_last": int(wire.Flags.LAST), "last_packets": wire.LAST_PACKETS,
        "flag_release": int(wire.Flags.RELEASE), "kinds": KINDS,
        "job_id": config.job_id, "rank": config.rank, "rx_fd": fd, "gro": gro, "offload": config.offload,
        "max_datagram": max_datagram(config), "protect": config.protection,
        "rx_batch": config.rx_batch, "batch_bytes": 1 << 30, "socket_buffer": config.socket_buffer,
        "park_limit": config.park_limit, "top_priority": pol.top_priority, "dscp": list(pol.dscp),
        "shares": [float(s) for s in pol.shares()], "magnitude": pol.magnitude,
        "parallel_magnitude_elems": PARALLEL_MAGNITUDE_ELEMS, "magnitude_threads": magnitude_threads(),
        "sampled_classes_packets": SAMPLED_CLASSES_PACKETS, "class_sample": CLASS_SAMPLE,
        "line_rate": config.rate.line_rate, "burst_bytes": float(config.rate.burst_bytes),
        "pacing_slack": config.rate.pacing_slack,
        "max_inline_wait": MAX_INLINE_WAIT,
        # a pass's end wakes the control thread no later than its earliest deadline, a probe
        "event_defer": config.probe_delay_min,
        "drop_p": [float(p) for p in loss.drop_probabilities], "delay": loss.delay, "delay_p": loss.delay_probability,
        "reorder": loss.reorder, "seed": loss.seed,
        "drain_stretch": DRAIN_STRETCH, "drain_min_bytes": float(DRAIN_MIN_BYTES), "drain_fresh": DRAIN_FRESH,
        "behind_backlog": BEHIND_BACKLOG,
        "answer_grace": config.probe_grace, "max_answer_grace": MAX_ANSWER_GRACE,
        "answer_gaps": ANSWER_GAPS, "max_busy_defer": MAX_BUSY_DEFER,
        "reorder_min": REORDER_MIN, "reorder_margin": REORDER_MARGIN, "reorder_decay": REORDER_DECAY,
        "reorder_persist": REORDER_PERSIST,
        "fresh_window": FRESH_WINDOW, "fresh_kept": FRESH_KEPT,
        "source_port_base": config.source_port_base or 0,
    }
