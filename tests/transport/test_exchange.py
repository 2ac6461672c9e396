"""Parameter server and ring allreduce over real loopback sockets, 2-4 workers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest

from dlcp.hostagent import wire
from dlcp.hostagent.exchange import PSServer, PSWorker, RingAllreduce, aggregate, message_id
from dlcp.hostagent.messages import Expect, MessageStats, RecvResult
from dlcp.hostagent.packetizer import elems_per_packet
from dlcp.hostagent.policy import Policy, payload_drop_classes
from dlcp.hostagent.transport import LossInjection

SHAPES = [(3, 5), (1000,), (64, 33), (1,), (7, 7, 7), (120_000,)]


def _grads(n_workers: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(n_workers)]


def _run_threads(fns):
    out, errors = {}, []

    def wrap(k, fn):
        try:
            out[k] = fn()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(k, fn)) for k, fn in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _ps(endpoints, n_workers, iterations=2, missing="zero", per_rank=None, policy=None):
    eps = endpoints(n_workers + 1, per_rank=per_rank, **({"policy": policy} if policy else {}))
    server = PSServer(eps[n_workers], list(range(n_workers)), missing=missing)
    workers = [PSWorker(eps[w], server_rank=n_workers) for w in range(n_workers)]
    results = []
    for it in range(iterations):
        grads = _grads(n_workers, it)
        n_msgs = len(workers[0].plan([int(np.prod(s)) for s in SHAPES]))  # fused: one message per bucket
        fns: dict[int | str, Callable[[], object]] = {"server": partial(server.serve_iteration, it, n_msgs)}
        fns.update({w: partial(workers[w].exchange, it, grads[w]) for w in range(n_workers)})
        results.append((grads, _run_threads(fns), server))
    return results


@pytest.mark.parametrize("n_workers", [2, 3, 4])
def test_parameter_server_equals_numpy_mean(endpoints, n_workers):
    policy = Policy(loss_bound_push=0.0)
    for grads, out, _ in _ps(endpoints, n_workers, policy=policy):
        for t, shape in enumerate(SHAPES):
            mean = np.mean([grads[w][t] for w in range(n_workers)], axis=0)
            for w in range(n_workers):
                assert out[w][t].shape == shape
                np.testing.assert_allclose(out[w][t], mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gather", ["direct", "ring"])
@pytest.mark.parametrize("n_workers", [2, 3, 4])
def test_ring_allreduce_equals_numpy_mean(endpoints, n_workers, gather):
    eps = endpoints(n_workers, policy=Policy(loss_bound_push=0.0))
    rings = [RingAllreduce(ep, list(range(n_workers)), gather=gather) for ep in eps]
    for it in range(2):
        grads = _grads(n_workers, 10 + it)
        out = _run_threads({w: (lambda w=w, it=it, g=grads: rings[w].allreduce(it, g[w])) for w in range(n_workers)})
        for t, shape in enumerate(SHAPES):
            mean = np.mean([grads[w][t] for w in range(n_workers)], axis=0)
            for w in range(n_workers):
                assert out[w][t].shape == shape
                np.testing.assert_allclose(out[w][t], mean, rtol=1e-5, atol=1e-6)


def test_parameter_server_error_with_loss_is_bounded_by_what_was_lost(endpoints):
    n = 3
    loss = LossInjection(drop_probabilities=(0, 0, 0.2, 0.2), seed=5)  # about 10 % of packets
    policy = Policy(loss_bound_push=0.1)
    runs = _ps(endpoints, n, iterations=1, per_rank={n: {"loss": loss}}, policy=policy)
    grads, out, server = runs[0]
    stats = server.history[0]
    assert 0 < stats.lost_fraction_max <= 0.1
    # The bound holds per message, and the tensors travel fused into one bucket: check the whole.
    xs = np.stack([np.concatenate([g.reshape(-1) for g in grads[w]]) for w in range(n)])
    got = np.concatenate([o.reshape(-1) for o in out[0]])
    err = np.abs(got - xs.mean(axis=0))
    # a wrong element is one where some contribution went missing: its error is at most
    # the sum of the contributions divided by N, and such elements are at most N * p
    assert (err <= np.abs(xs).sum(axis=0) / n + 1e-6).all()
    assert (err > 1e-6).mean() <= n * 0.1 + 1e-9
    for w in range(1, n):  # the pull is reliable: every worker got the same answer
        for t in range(len(SHAPES)):
            np.testing.assert_array_equal(out[w][t], out[0][t])


@pytest.mark.parametrize("gather", ["direct", "ring"])
def test_ring_allreduce_error_with_loss_is_bounded(endpoints, gather):
    n = 3
    loss = LossInjection(drop_probabilities=(0, 0, 0.2, 0.2), seed=6)
    eps = endpoints(n, policy=Policy(loss_bound_push=0.1), loss=loss)
    rings = [RingAllreduce(ep, list(range(n)), gather=gather) for ep in eps]
    grads = _grads(n, 3)
    out = _run_threads({w: (lambda w=w: rings[w].allreduce(0, grads[w])) for w in range(n)})
    assert any(r.last_stats is not None and r.last_stats.lost_fraction_max > 0 for r in rings)
    xs = np.stack([np.concatenate([g.reshape(-1) for g in grads[w]]) for w in range(n)])  # fused: one bucket
    err = np.abs(np.concatenate([o.reshape(-1) for o in out[0]]) - xs.mean(axis=0))
    assert (err <= np.abs(xs).sum(axis=0) / n + 1e-5).all()
    # each reduce-scatter hop may lose up to p of a chunk
    assert (err > 1e-5).mean() <= (n - 1) * 0.1 + 1e-9
    for w in range(1, n):
        for t in range(len(SHAPES)):
            np.testing.assert_array_equal(out[w][t], out[0][t])


@pytest.mark.parametrize("classify", [True, False])
def test_a_ring_of_data_that_is_not_gradients_puts_every_packet_in_the_class_dropped_last(endpoints, classify):
    """``classify=False`` (the backend's collectives outside a backward pass): every packet of
    every step, the forwarded ones too, goes in drop class 0, so a receiver that drops classes
    1-3 drops none of them; a classifying ring's packets spread over the classes (and lose
    some, which the lossless ring recovers). Both sum exactly."""
    n = 3
    loss = LossInjection(drop_probabilities=(0, 0.3, 0.3, 0.3), seed=2)
    eps = endpoints(n, policy=Policy(loss_bound_push=0.0), loss=loss)
    rings = [RingAllreduce(ep, list(range(n)), classify=classify) for ep in eps]
    grads = _grads(n, 4)
    out = _run_threads({w: (lambda w=w: rings[w].allreduce(0, grads[w])) for w in range(n)})
    for t in range(len(SHAPES)):
        mean = np.mean([grads[w][t] for w in range(n)], axis=0)
        for w in range(n):
            np.testing.assert_allclose(out[w][t], mean, rtol=1e-5, atol=1e-6)
    dropped = sum(sum(ep.stats.injected_drops.values()) for ep in eps)
    resent = sum(ep.stats.retransmitted_pkts for ep in eps)
    if classify:
        assert dropped > 0 and resent > 0
    else:
        assert dropped == 0 and resent == 0


@pytest.mark.parametrize("dtype", [np.float32, wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]], ids=["float32", "bfloat16"])
def test_a_forwarded_sum_leaves_with_the_drop_classes_of_what_it_carries(endpoints, dtype):
    """A ring's forwarding send takes its packets' magnitudes from the receive that made its
    data (computed as each packet was added or placed, float32 and bfloat16 alike), not from a
    pass of its own; each packet's class is still the policy's rule applied to what is sent.
    The classes are read where the data path writes them for the sender (``TxSpec.drop_class``)."""
    n, size = 2, 40_000
    eps = endpoints(n, policy=Policy(loss_bound_push=0.0))
    specs: list[list] = [[] for _ in range(n)]
    for w, ep in enumerate(eps):
        submit = ep.dp.submit

        def spy(spec, submit=submit, w=w):  # (records each send the core hands the real data path)
            specs[w].append(spec)
            submit(spec)

        ep.dp.submit = spy
    rings = [RingAllreduce(ep, list(range(n))) for ep in eps]
    rng = np.random.default_rng(8)
    data = [(rng.standard_normal(size) * 10.0 ** rng.integers(-2, 3, size)).astype(dtype) for _ in range(n)]
    bufs = [d.copy() for d in data]
    _run_threads({w: (lambda w=w: rings[w].sum_inplace(0, [bufs[w]])) for w in range(n)})
    want = (data[0].astype(np.float32) + data[1].astype(np.float32)).astype(dtype)  # (one rounded addition)
    bits = np.uint32 if dtype == np.float32 else np.uint16
    for w in range(n):
        np.testing.assert_array_equal(bufs[w].view(bits), want.view(bits))
    per = elems_per_packet(eps[0].config.mtu, np.dtype(dtype))
    bounds = rings[0]._chunking.bounds(size)
    for r in range(n):  # rank r sends its own chunk r, then the sum of chunk r + 1 it completed
        c = (r + 1) % n
        first, forwarded = sorted(specs[r], key=lambda spec: spec.message_id)
        np.testing.assert_array_equal(first.drop_class,
                                      payload_drop_classes(data[r][bounds[r]:bounds[r + 1]], per, Policy()))
        np.testing.assert_array_equal(forwarded.drop_class,
                                      payload_drop_classes(want[bounds[c]:bounds[c + 1]], per, Policy()))
        assert len(set(forwarded.drop_class.tolist())) > 1


def test_ring_refuses_an_unknown_gather(endpoints):
    ep, _ = endpoints(2)
    with pytest.raises(ValueError, match="gather must be"):
        RingAllreduce(ep, [0, 1], gather="tree")  # type: ignore[arg-type]  # not a GatherMode, on purpose


def _result(data, received=None, per=1):
    stats = MessageStats(peer=0, message_id=0, direction="recv", elements=len(data), packets=len(data),
                         bytes=0, loss_bound=0.1)
    return RecvResult(np.asarray(data, np.float32), stats,
                      None if received is None else np.asarray(received, bool), per)


def test_aggregate_missing_rules_by_hand():
    # worker 0 lost its second packet (elements 2-3), worker 1 delivered everything
    a = _result([2, 2, 0, 0], received=[True, False], per=2)
    b = _result([4, 4, 4, 4])
    np.testing.assert_array_equal(aggregate([a, b], 2, "zero"), [3, 3, 2, 2])
    np.testing.assert_array_equal(aggregate([a, b], 2, "present"), [3, 3, 4, 4])
    nobody = _result([0, 0], received=[False], per=2)
    np.testing.assert_array_equal(aggregate([nobody, nobody], 2, "present"), [0, 0])


def test_message_id_layout():
    assert message_id(0, 0, 0) == 0
    assert message_id(1, 2, 3) == (1 << 22) | (3 << 16) | 2
    assert message_id(1024, 5, 1) == message_id(0, 5, 1)  # wraps every 1024 iterations
    with pytest.raises(ValueError):
        message_id(0, 1 << 16, 0)
    with pytest.raises(ValueError):
        message_id(0, 0, 64)


def test_dynamic_server_sees_messages_announced_before_it_started(endpoints):
    """A worker may push before the server asks for announcements: nothing may be missed."""
    import threading

    eps = endpoints(3, policy=Policy(loss_bound_push=0.0))
    server_ep = eps[2]
    grads = {w: np.full(1000, w + 1, np.float32) for w in (0, 1)}
    # the server replies without a META: a worker posts its pull with the size it expects
    pulls = {w: eps[w].recv(2, message_id(0, 5, 1), expect=Expect(1000, np.float32, 0.0)) for w in (0, 1)}
    for w in (0, 1):
        eps[w].send(2, grads[w], message_id(0, 5, 0))
    import time

    time.sleep(0.3)  # both pushes are complete at the server before it serves
    server = PSServer(server_ep, [0, 1])
    stop = threading.Event()
    t = threading.Thread(target=server.serve_forever, args=(stop,))
    t.start()
    try:
        for w in (0, 1):
            np.testing.assert_array_equal(pulls[w].wait(10).data, np.full(1000, 1.5, np.float32))
    finally:
        stop.set()
        t.join(5)


def test_exchange_rejects_mismatched_ids(endpoints):
    eps = endpoints(2)
    worker = PSWorker(eps[0], server_rank=1)
    with pytest.raises(ValueError, match="tensor ids and priorities"):
        worker.exchange_detailed(0, [np.ones(3, np.float32)], tensor_ids=[1, 2])
    with pytest.raises(ValueError, match="distinct"):
        worker.exchange_detailed(0, [np.ones(3, np.float32)] * 2, tensor_ids=[1, 1])


def test_ring_reports_what_its_sends_lost(endpoints):
    """Two members: each reduce-scatter send is the member's own chunk, so what it lost is its
    own gradient there, and the average at those elements holds only the other's half."""
    loss = LossInjection(drop_probabilities=(0, 0, 0, 1.0), seed=4)  # every class-3 packet
    eps = endpoints(2, policy=Policy(loss_bound_push=0.3), loss=loss)
    rings = [RingAllreduce(ep, [0, 1]) for ep in eps]
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal(40_000).astype(np.float32) for _ in range(2)]
    out = _run_threads({w: (lambda w=w: rings[w].allreduce_detailed(0, [grads[w]])) for w in range(2)})
    for w in range(2):
        avg, idx, vals = out[w][0]
        assert 0 < len(idx) <= 0.3 * 20_000 + 1000
        np.testing.assert_array_equal(vals, grads[w][idx])
        np.testing.assert_allclose(avg[idx], grads[1 - w][idx] / 2, rtol=1e-6)
        np.testing.assert_array_equal(avg, out[1 - w][0][0])  # the all-gather is reliable


def test_ring_without_lost_values_keeps_indices_and_reuses_no_stale_snapshot(endpoints):
    """``lost_values=False`` skips the snapshot of every partial sum (only error feedback needs
    it): the lost indices still come back, with zero values. Snapshots reused across calls
    must hold each call's own values."""
    loss = LossInjection(drop_probabilities=(0, 0, 0, 1.0), seed=4)
    eps = endpoints(2, policy=Policy(loss_bound_push=0.3), loss=loss)
    rings = [RingAllreduce(ep, [0, 1]) for ep in eps]
    rng = np.random.default_rng(9)
    for it, want in enumerate([False, True, True]):
        grads = [rng.standard_normal(40_000).astype(np.float32) for _ in range(2)]
        out = _run_threads({w: (lambda w=w, it=it, g=grads, want=want:
                                 rings[w].allreduce_detailed(it, [g[w]], lost_values=want))
                            for w in range(2)})
        for w in range(2):
            _, idx, vals = out[w][0]
            assert len(idx) > 0
            if want:
                np.testing.assert_array_equal(vals, grads[w][idx])
            else:
                assert not vals.any()


def test_parameter_server_serves_iterations_back_to_back(endpoints):
    """``serve`` posts each next iteration's receives ahead, into the bank its iteration before
    last used: every iteration's average must still be its own (workers run ahead freely)."""
    n, iterations = 3, 4
    eps = endpoints(n + 1, policy=Policy(loss_bound_push=0.0))
    server = PSServer(eps[n], list(range(n)))
    workers = [PSWorker(eps[w], server_rank=n) for w in range(n)]
    grads = [_grads(n, 20 + it) for it in range(iterations)]
    n_msgs = len(workers[0].plan([int(np.prod(s)) for s in SHAPES]))

    def work(w):
        return [workers[w].exchange(it, grads[it][w]) for it in range(iterations)]

    fns: dict[int | str, Callable[[], object]] = {"server": lambda: server.serve(iterations, n_msgs)}
    fns.update({w: partial(work, w) for w in range(n)})
    out = _run_threads(fns)
    for it in range(iterations):
        for t in range(len(SHAPES)):
            mean = np.mean([grads[it][w][t] for w in range(n)], axis=0)
            for w in range(n):
                np.testing.assert_allclose(out[w][it][t], mean, rtol=1e-5, atol=1e-6)
    assert not server._posted  # nothing left posted after the last iteration


def test_an_inplace_allreduce_with_one_bad_buffer_changes_none(endpoints):
    ep, _ = endpoints(2)
    ring = RingAllreduce(ep, [0, 1])
    good = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        ring.allreduce_inplace(0, [good, np.ones(10, np.float64)])
    np.testing.assert_array_equal(good, np.ones(10, np.float32))


BF16 = wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]
#: The 2-byte types a ring sums in their own type, and how close to the float32 mean each gets.
HALF_TYPES = [pytest.param(np.dtype(np.float16), 5e-3, id="float16"), pytest.param(BF16, 3e-2, id="bfloat16")]


def _half_ring_sum(parts: list[np.ndarray], n: int, pos: int) -> np.ndarray:
    """What a 2-byte ring leaves in chunk ``pos``: reduce-scatter starts the chunk at member
    ``pos`` and adds each next member's part (divided by n in its type) as it goes around,
    rounding each addition to the type, as the receive path adds them."""
    order = [(pos + k) % n for k in range(n)]
    acc = parts[order[0]].copy()
    for r in order[1:]:
        acc = (acc + parts[r]).astype(acc.dtype)
    return acc


@pytest.mark.parametrize("dtype, atol", HALF_TYPES)
@pytest.mark.parametrize("n_workers", [2, 3])
def test_a_half_precision_ring_travels_and_sums_in_its_type(endpoints, n_workers, dtype, atol):
    """allreduce_inplace on float16 (bfloat16) buffers: half the bytes of float32 on the wire,
    every member ends with the same bits, each chunk summed in its type in the ring's order (as
    gloo sums a float16 or bfloat16 tensor), and so within its precision of the float32 mean."""
    rng = np.random.default_rng(4)
    size = 5000
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(n_workers)]
    eps = endpoints(n_workers, policy=Policy(loss_bound_push=0.0))
    rings = [RingAllreduce(ep, list(range(n_workers))) for ep in eps]
    halves = [g.astype(dtype) for g in grads]
    scaled = [h / dtype.type(n_workers) for h in halves]
    _run_threads({w: partial(rings[w].allreduce_inplace, 0, [halves[w]]) for w in range(n_workers)})
    for w in range(1, n_workers):
        np.testing.assert_array_equal(halves[w].view(np.uint16), halves[0].view(np.uint16))
    bounds = np.linspace(0, size, n_workers + 1).astype(int)
    for c in range(n_workers):
        lo, hi = bounds[c], bounds[c + 1]
        want = _half_ring_sum([s[lo:hi] for s in scaled], n_workers, c)
        np.testing.assert_array_equal(halves[0][lo:hi].view(np.uint16), want.view(np.uint16))
    np.testing.assert_allclose(halves[0].astype(np.float32), np.mean(grads, axis=0), atol=atol)
    sent = rings[0].last_stats
    assert sent is not None
    float32_bytes = 2 * (n_workers - 1) * size // n_workers * 4
    assert sent.bytes_sent < 0.6 * float32_bytes  # payload at 2 bytes an element (headers aside)


@pytest.mark.parametrize("n_workers", [3, 4])
def test_a_float32_ring_in_place_gives_the_same_bits_on_both_data_paths(endpoints, n_workers):
    """allreduce_inplace on float32: each member's part multiplied by float32(1/n), each chunk
    summed in the ring's order. Both data paths multiply while their reduce-scatter receives
    add (``Expect.scale``), each operation rounded in float32: exactly the bits of scaling
    first (3: a factor that is not a power of two)."""
    rng = np.random.default_rng(11)
    size = 30011
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(n_workers)]
    eps = endpoints(n_workers, policy=Policy(loss_bound_push=0.0))
    rings = [RingAllreduce(ep, list(range(n_workers))) for ep in eps]
    bufs = [g.copy() for g in grads]
    _run_threads({w: partial(rings[w].allreduce_inplace, 0, [bufs[w]]) for w in range(n_workers)})
    scaled = [g * np.float32(1.0 / n_workers) for g in grads]
    bounds = np.linspace(0, size, n_workers + 1).astype(int)
    for c in range(n_workers):
        lo, hi = bounds[c], bounds[c + 1]
        want = _half_ring_sum([x[lo:hi] for x in scaled], n_workers, c)
        for w in range(n_workers):
            np.testing.assert_array_equal(bufs[w][lo:hi].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_a_half_precision_parameter_server_sums_in_float32_and_answers_in_the_pushes_type(endpoints, dtype):
    """Workers push float16 (bfloat16); the server adds them in float32 and answers in their
    type, so the pulled average is the float32 mean of the pushes, rounded once to it."""
    n_workers = 3
    eps = endpoints(n_workers + 1, policy=Policy(loss_bound_push=0.0))
    server = PSServer(eps[n_workers], list(range(n_workers)))
    workers = [PSWorker(eps[w], server_rank=n_workers) for w in range(n_workers)]
    rng = np.random.default_rng(6)
    for it in range(3):  # the first iteration learns sizes and types; the later ones add as packets arrive
        halves = [rng.standard_normal(7000).astype(dtype) for _ in range(n_workers)]
        fns: dict[int | str, Callable[[], object]] = {"server": partial(server.serve_iteration, it, 1)}
        fns.update({w: partial(workers[w].exchange_detailed, it, [halves[w]]) for w in range(n_workers)})
        out = _run_threads(fns)
        want = (np.sum([h.astype(np.float32) for h in halves], axis=0) * np.float32(1 / n_workers)).astype(dtype)
        for w in range(n_workers):
            (avg, _), = out[w]
            assert avg.dtype == dtype
            np.testing.assert_array_equal(avg.view(np.uint16), want.view(np.uint16))


def test_a_worker_pulls_into_its_own_buffers_iteration_after_iteration(endpoints):
    """``out``: the averages land in the caller's arrays (reused, as a training loop or the
    benchmark reuses them), each iteration's its own."""
    n, sizes = 2, [1000, 120_000]
    eps = endpoints(n + 1, policy=Policy(loss_bound_push=0.0))
    server = PSServer(eps[n], list(range(n)))
    workers = [PSWorker(eps[w], server_rank=n) for w in range(n)]
    outs = [[np.full(s, np.nan, np.float32) for s in sizes] for _ in range(n)]
    for it in range(3):
        rng = np.random.default_rng(it)
        grads = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]
        fns: dict[int | str, Callable[[], object]] = {"server": partial(server.serve_iteration, it, len(sizes))}
        fns.update({w: partial(workers[w].exchange_detailed, it, grads[w], out=outs[w]) for w in range(n)})
        res = _run_threads(fns)
        for w in range(n):
            for t in range(len(sizes)):
                avg, _ = res[w][t]
                assert np.shares_memory(avg, outs[w][t])
                np.testing.assert_allclose(outs[w][t], (grads[0][t] + grads[1][t]) / 2, rtol=1e-6, atol=1e-6)


def test_bad_pull_buffers_are_refused_before_anything_is_posted(endpoints):
    eps = endpoints(2, policy=Policy(loss_bound_push=0.0))
    server, worker = PSServer(eps[1], [0]), PSWorker(eps[0], server_rank=1)
    grads = [np.arange(10, dtype=np.float32), np.ones(5, np.float32)]
    good = np.empty(10, np.float32)
    frozen = np.empty(5, np.float32)
    frozen.flags.writeable = False
    both = np.empty(15, np.float32)
    cases: list[tuple[list[np.ndarray], str]] = [
        ([good], "1 pull buffers for 2 tensors"),
        ([good, np.empty(5, np.float64)], "pull buffer 1 must be"),
        ([good, np.empty(6, np.float32)], "pull buffer 1 must be"),
        ([good, frozen], "pull buffer 1 must be"),
        ([good, grads[1]], "overlaps a pushed array"),
        ([both[:10], both[9:14]], "overlaps another pull buffer")]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            worker.exchange_detailed(0, grads, out=out)
    # nothing of those calls was posted or sent: the same iteration then runs cleanly, into
    # two slices of one buffer that touch but do not overlap
    res = _run_threads({"server": partial(server.serve_iteration, 0, 2),
                        0: partial(worker.exchange_detailed, 0, grads, out=[both[:10], both[10:]])})
    np.testing.assert_array_equal(both, np.concatenate(grads))
    assert len(res[0]) == 2


@pytest.mark.parametrize("n_workers", [2, 3])
def test_rings_of_tensors_smaller_than_the_group_never_wait_on_their_empty_chunks(endpoints, n_workers):
    """A 1-element sum leaves some ranks empty chunks: empty held sends whose pass ends the
    moment their trigger fires. The data path reported that end before the start, and the
    sender then waited on a pass that was over until its deadline (barriers hung)."""
    eps = endpoints(n_workers, message_deadline=10.0)
    for ep in eps:
        ep.connect()
    rings = [RingAllreduce(ep, list(range(n_workers)), timeout=10.0) for ep in eps]
    for it in range(1, 41):
        bufs = [np.full(1, r + 1, np.float32) for r in range(n_workers)]
        _run_threads({r: partial(rings[r].sum_inplace, it, [bufs[r]]) for r in range(n_workers)})
        assert [b[0] for b in bufs] == [n_workers * (n_workers + 1) / 2] * n_workers
