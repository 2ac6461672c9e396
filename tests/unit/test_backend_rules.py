"""The ``dlcp`` backend's pure parts: argument checks, bucket priorities, and DLCPWork's
failure semantics (no processes, no sockets)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from dlcp_torch import collective_checks as checks  # noqa: E402
from dlcp_torch.bucket_order import BackwardOrder, bucket_priority  # noqa: E402
from dlcp_torch.work import DLCPWork  # noqa: E402
from dlcp.hostagent.policy import Policy  # noqa: E402


@pytest.mark.parametrize("op, dtype", [
    (dist.ReduceOp.SUM, torch.uint16), (dist.ReduceOp.SUM, torch.float8_e4m3fn), (dist.ReduceOp.BAND, torch.float32),
    (dist.ReduceOp.AVG, torch.bool), (dist.ReduceOp.MAX, torch.complex64), (dist.ReduceOp.AVG, torch.int64),
])
def test_a_reduction_its_type_does_not_take_is_refused_by_name(op, dtype):
    with pytest.raises(ValueError, match=str(dtype)) as refused:
        checks.reduce_op(op, [dtype], "all_reduce")
    assert isinstance(refused.value, RuntimeError)  # (what gloo raises: a script's except catches it)


def test_premul_sum_is_refused_by_name():
    with pytest.raises(ValueError, match="PREMUL_SUM is not supported"):
        checks.reduce_op(dist._make_nccl_premul_sum(2.0), [torch.float32], "all_reduce")


@pytest.mark.parametrize("op, dtype", [
    (dist.ReduceOp.SUM, torch.float32), (dist.ReduceOp.AVG, torch.bfloat16), (dist.ReduceOp.MAX, torch.int64),
    (dist.ReduceOp.BXOR, torch.uint8), (dist.ReduceOp.MIN, torch.bool), (dist.ReduceOp.BOR, torch.bool),
])
def test_reductions_gloo_takes_pass(op, dtype):
    checks.reduce_op(op, [dtype], "all_reduce")


def test_roots_lists_and_sizes_are_checked():
    with pytest.raises(ValueError, match="root rank 5 is not in this group of 2"):
        checks.root(5, 2, "broadcast")
    one = torch.zeros(3)
    with pytest.raises(ValueError, match="list 0 has 1 tensors for a group of 2"):
        checks.gather_lists([[one]], [one], 2, "all_gather")
    with pytest.raises(ValueError, match=r"tensor 1 of list 0 is 4 x torch.float32; expected 3"):
        checks.gather_lists([[one, torch.zeros(4)]], [one], 2, "all_gather")
    with pytest.raises(ValueError, match="sparse"):
        checks.tensors([torch.zeros(2).to_sparse()], "all_reduce")


def test_bucket_priorities_follow_the_backward_order():
    policy = Policy(num_priorities=4)
    assert bucket_priority(0, None, policy) == policy.top_priority  # first pass: not known yet
    # 4 buckets, last layers first: the first issued is the last layer (lowest), the last the first (highest)
    assert [bucket_priority(k, 4, policy) for k in range(4)] == [0, 1, 2, 3]
    assert bucket_priority(9, 4, policy) == 3  # a longer pass than the last: its tail is the first layers


def test_backward_order_counts_each_pass():
    order = BackwardOrder(Policy(num_priorities=2))
    first = [order.priority(graph_task=1) for _ in range(4)]
    second = [order.priority(graph_task=2) for _ in range(4)]
    assert first == [1, 1, 1, 1] and second == [0, 0, 1, 1] and order.last_count == 4


def test_a_failed_work_raises_from_wait_and_from_its_future():
    work = DLCPWork("all_reduce #1")
    work.finish(error=dist.DistBackendError("peer gone"))
    assert work.is_completed() and not work.is_success()
    with pytest.raises(dist.DistBackendError, match="peer gone"):
        work.wait()
    with pytest.raises(RuntimeError, match="peer gone"):  # the future's error is a C++ one: value() raises
        work.get_future().value()


def test_a_work_returns_its_value_and_honours_a_wait_timeout():
    from datetime import timedelta

    pending = DLCPWork("barrier #2")
    with pytest.raises(dist.DistBackendError, match="did not finish within the 0.05 s"):
        pending.wait(timedelta(seconds=0.05))
    done = DLCPWork("all_reduce #3")
    t = torch.ones(2)
    done.finish(value=[t])
    assert done.wait() is True and done.get_future().wait()[0] is t


def test_a_reduce_op_from_the_options_has_the_name_of_its_type():
    """``AllreduceOptions.reduceOp`` is a ReduceOp, ``ReduceOp.SUM`` a RedOpType: ``in`` over a
    tuple of the latter said False, and every float32 all_reduce missed the ring."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # (torch converts it, as dist.all_reduce does)
    assert checks.op_name(opts.reduceOp) == "AVG" and checks.op_name(dist.ReduceOp.SUM) == "SUM"


def test_options_from_the_environment_and_what_they_refuse(monkeypatch):
    """DLCP_* variables set the backend's options; a value they cannot mean is refused, naming it."""
    from dlcp_torch.backend import BackendOptions

    for var in [v for v in os.environ if v.startswith("DLCP_")]:
        monkeypatch.delenv(var)
    base = BackendOptions.from_env()
    assert base.authenticate and not base.encrypt and base.mtu is None and base.line_rate is None
    monkeypatch.setenv("DLCP_LOSS_BOUND", "0")
    monkeypatch.setenv("DLCP_MTU", "1500")
    monkeypatch.setenv("DLCP_LINE_RATE", "10")
    monkeypatch.setenv("DLCP_ENCRYPT", "1")
    opts = BackendOptions.from_env()
    assert (opts.policy.loss_bound_push, opts.mtu, opts.line_rate, opts.encrypt) == (0.0, 1500, 10e9 / 8, True)
    monkeypatch.setenv("DLCP_AUTHENTICATE", "0")
    with pytest.raises(ValueError, match="encrypt=True needs authenticate=True"):
        BackendOptions.from_env()
    monkeypatch.delenv("DLCP_ENCRYPT")
    assert not BackendOptions.from_env().authenticate
    monkeypatch.setenv("DLCP_AUTHENTICATE", "no")
    with pytest.raises(ValueError, match="DLCP_AUTHENTICATE='no' must be 0 or 1"):
        BackendOptions.from_env()
    monkeypatch.setenv("DLCP_AUTHENTICATE", "1")
    monkeypatch.setenv("DLCP_MTU", "big")
    with pytest.raises(ValueError, match="DLCP_MTU='big' is not a number"):
        BackendOptions.from_env()


def test_the_endpoint_follows_the_line_rate_its_start_burst_and_report_interval():
    """The backend configures a link of ``line_rate`` as the testbed configures its hosts: start
    at half, a burst of at most 0.2 ms of the link (at least 16 datagrams), congestion reports
    spaced for the link (:func:`link_timers`). On a 7.4 Mbit/s link, 256 KB back to back was a
    quarter of a second."""
    from dlcp.hostagent.ratecontrol import link_rates
    from dlcp.hostagent.transport_config import TransportConfig, link_timers, local_peers
    from dlcp_torch.backend import BackendOptions, _transport_config

    slow = 7.4e6 / 8
    reports = []
    for rate, burst in ((slow, 16 * 1500), (1e9 / 8, 25_000), (100e9 / 8, 256 * 1024)):
        opts = BackendOptions(line_rate=rate, mtu=1500)
        cfg, line = _transport_config(0, local_peers(2, 40000), opts, "127.0.0.1", 30.0, b"s" * 32)
        assert cfg.rate.line_rate == rate and cfg.rate.initial_rate == rate / 2 and cfg.rate.burst_bytes == burst
        assert cfg.feedback_interval == link_timers(rate, 1500)["feedback_interval"]
        assert "(configured)" in line
        reports.append(cfg.feedback_interval)
    assert reports[0] > reports[1] == reports[2] == TransportConfig.feedback_interval  # fast links: the default
    knobs = link_rates(slow, 1500)  # what the testbed's own agents get for the same link
    assert (knobs["initial_rate"], knobs["burst_bytes"]) == (slow / 2, 16 * 1500)

    # ranks that agree on a smaller MTU burst in datagrams of that MTU
    from dlcp_torch.backend import _agree_on_mtu

    class Store:  # (the two calls of a torch Store it makes)
        def __init__(self) -> None:
            self.kv = {"dlcp/mtu/1": "576"}

        def set(self, k: str, v: str) -> None:
            self.kv[k] = v

        def get(self, k: str) -> bytes:
            return self.kv[k].encode()

    store = Store()
    cfg, _ = _transport_config(0, local_peers(2, 40000), BackendOptions(line_rate=slow, mtu=1500), "127.0.0.1",
                               30.0, b"s" * 32)
    agreed, line = _agree_on_mtu(store, 0, 2, cfg, "")  # type: ignore[arg-type]
    assert (agreed.mtu, agreed.rate.burst_bytes) == (576, 16 * 576) and "every rank uses MTU 576" in line
    assert agreed.feedback_interval == link_timers(slow, 576)["feedback_interval"]
