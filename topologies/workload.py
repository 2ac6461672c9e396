"""A synthetic testbed workload as the agents build it: per-tensor sizes, priorities, buckets.

One definition, read by the agent that sends the gradients (:mod:`dlcp.topologies.agent`) and by
what reasons about them without sending (the line-rate bound, the benchmark), so both see
the same messages. Light on purpose: no torch, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dlcp.hostagent.fusion import Bucket, FusionConfig, plan_buckets
from dlcp.hostagent.model_profiles import layer_sizes
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import Policy, layer_priorities

#: Testbed workloads that train a real model (:mod:`dlcp_torch.workloads`) instead of
#: exchanging synthetic gradients; the agent runs them with ``run_training``.
TRAINING_WORKLOADS = ("digits", "mnist1d")


def fusion_for(spec: Mapping) -> FusionConfig:
    """DDP's bucket caps scaled like the model (``scale``), at least ``bucket_floor_packets``
    full packets; one message per tensor when ``fusion`` is off."""
    floor = spec.get("bucket_floor_packets", 8) * elems_per_packet(spec["mtu"], np.float32) * 4
    return FusionConfig(enabled=spec.get("fusion", True)).scaled(spec["scale"], min_bytes=floor)


def worker_plan(spec: Mapping, policy: Policy | None = None) -> tuple[list[int], np.ndarray, list[Bucket]]:
    """(tensor sizes, layer priorities, buckets) of one worker's iteration for ``spec``.

    Raises:
        ValueError: ``spec["model"]`` is not a synthetic profile (``digits`` trains a real model
            whose buckets are built at run time).
    """
    policy = policy or Policy.from_dict(spec["policy"])
    sizes = layer_sizes(spec["model"], spec["scale"])
    prio = layer_priorities(sizes, policy)
    return sizes, prio, plan_buckets(sizes, [int(x) for x in prio], config=fusion_for(spec))
