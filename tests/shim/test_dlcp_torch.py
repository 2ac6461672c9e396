"""The PyTorch shim with real processes, real gloo, real training on loopback."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dlcp_torch
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.transport import Endpoint, LossInjection, TransportConfig
from tests.conftest import loopback_peers
from tests.shim.ranks import rank_context

STEPS = 8


def _port() -> tuple[int, int]:
    """Distinct free ports for torch's store (MASTER_PORT) and DLCP's (DLCP_STORE_PORT)."""
    from dlcp.hostagent.loopback import free_tcp_ports

    udp, tcp = free_tcp_ports(2)
    return udp, tcp


def _env(rank, world, ports):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]),
                      DLCP_STORE_PORT=str(ports[1]))


def _train(rank, world, how, port, out):
    """One worker: DDP with gloo allreduce, DDP + dlcp_hook (ps/ring), or DistributedOptimizer;
    ``-fp16``: gloo with PyTorch's fp16_compress_hook, DLCP with wire_dtype="float16"."""
    how, _, fp16 = how.partition("-")
    _env(rank, world, port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    session = None
    policy = Policy(loss_bound_push=0.0)
    net: torch.nn.Module
    opt: torch.optim.Optimizer | dlcp_torch.DistributedOptimizer
    if how == "optimizer":
        session = dlcp_torch.init("ps", model=model, policy=policy, message_deadline=20)
        opt = dlcp_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, session.state)
        net = model
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if how == "gloo" and fp16:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif how != "gloo":
            session = dlcp_torch.init(how, model=model, policy=policy, message_deadline=20,
                                      wire_dtype="float16" if fp16 else "float32")
            ddp.register_comm_hook(session.state, dlcp_torch.dlcp_hook)
        net = ddp
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    out.put((rank, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()))
    if session is not None and rank == 1:  # a worker's gradient bytes (worker 0 also hosts the server)
        out.put(("bytes", session.endpoint.stats.data_bytes_sent))
    if how != "optimizer":
        dist.barrier()
    time.sleep(0.3)
    if session:
        session.close()
    if how != "optimizer":
        dist.destroy_process_group()


def _run(world, how):
    ctx = rank_context()
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_train, args=(r, world, how, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res = dict(out.get(timeout=180) for _ in range(len(procs) + (not how.startswith("gloo"))))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_lossless_equals_stock_ddp_with_gloo(world):
    ref = _run(world, "gloo")
    for how in ("ps", "ring", "optimizer"):
        got = _run(world, how)
        for r in range(world):
            np.testing.assert_allclose(got[r], ref[0], atol=1e-5, err_msg=f"{how}, rank {r}")


def test_float16_on_the_wire_trains_as_pytorchs_fp16_compress_hook():
    """DLCP with wire_dtype="float16" (ring: summed in float16; PS: in float32) against stock
    DDP with fp16_compress_hook: the same parameters to half precision's rounding, every rank
    alike, with half the bytes of float32 on the wire."""
    world = 3
    ref = _run(world, "gloo-fp16")
    for base in ("ring", "ps"):
        full, half = _run(world, base), _run(world, f"{base}-fp16")
        for r in range(world):
            np.testing.assert_allclose(half[r], ref[0], atol=1e-4, err_msg=f"{base}-fp16, rank {r}")
            np.testing.assert_array_equal(half[r], half[0])
        assert np.abs(half[0] - full[0]).max() > 0, base  # rounded to halves on the way
        assert half["bytes"] < 0.6 * full["bytes"], (base, half["bytes"], full["bytes"])


def _digits(**kw):
    from dlcp_torch.workloads.digits import WORKLOAD
    from dlcp_torch.workloads.loop import TrainConfig, run_local

    args: dict[str, Any] = dict(workers=3, pattern="ps", mode="ddp", steps=300, batch=32, lr=0.05, loss=0.0, bound=0.0,
                error_feedback=False, mtu=1500, timeout=300.0)
    args.update(kw)
    return run_local(TrainConfig(**args), WORKLOAD)


def test_bounded_loss_keeps_digits_accuracy():
    lossless = _digits()
    bounded = _digits(loss=0.05, bound=0.1)
    assert all(r["lost_mean"] > 0 for r in bounded)  # loss really happened, under the bound
    assert max(r["lost_mean"] for r in bounded) <= 0.1
    assert abs(bounded[0]["accuracy"] - lossless[0]["accuracy"]) <= 0.01 + 1e-9, (bounded[0], lossless[0])


def test_error_feedback_keeps_training_at_high_loss():
    ef = _digits(loss=0.3, bound=0.3, error_feedback=True, steps=150)
    assert ef[0]["lost_mean"] > 0.05
    assert ef[0]["accuracy"] >= 0.9


def test_error_feedback_carries_exactly_what_was_lost():
    peers = loopback_peers(2)
    drop = LossInjection(drop_probabilities=(0, 0, 0, 1.0), seed=0)  # every class-3 packet of a push is lost
    pol = Policy(loss_bound_push=0.3)
    server = Endpoint(TransportConfig(rank=1, peers=peers, policy=pol, loss=drop)).start()
    worker = Endpoint(TransportConfig(rank=0, peers=peers, policy=pol)).start()
    thread, stop = dlcp_torch.start_server(server, [0], pol)
    try:
        state = dlcp_torch.DLCPState(worker, "ps", workers=[0], server_rank=1, error_feedback=True)
        g1 = np.random.default_rng(0).standard_normal(20_000).astype(np.float32)
        avg1 = state.exchange_async(7, g1, 7).result(20)
        lost = avg1 == 0
        assert 0.2 < lost.mean() <= 0.3
        np.testing.assert_array_equal(state._errors[7][lost], g1[lost])  # the error is the lost part
        assert not state._errors[7][~lost].any()
        g2 = np.zeros_like(g1)
        avg2 = state.exchange_async(7, g2, 7).result(20)
        # the second push carried the first one's lost part: its packets are now the largest
        # (class 0, never dropped), so the server receives exactly what it missed before
        np.testing.assert_array_equal(avg2[lost], g1[lost])
        state.close()
        # the state pickles without its endpoint (checkpoints)
        restored = pickle.loads(pickle.dumps(state))
        assert restored.endpoint is None and restored.error_feedback
    finally:
        stop.set()
        thread.join(5)
        worker.close()
        server.close()


def _doomed(rank, world, port, out):
    _env(rank, world, port)
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 2)
    session = dlcp_torch.init("ring", model=model, message_deadline=5)
    opt = dlcp_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, session.state)
    out.put((rank, "ready"))
    t0 = time.monotonic()
    try:
        for _ in range(100000):
            opt.zero_grad()
            model(torch.randn(4, 10)).sum().backward()
            t0 = time.monotonic()
            opt.step()
    except Exception as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
    session.close()


def test_worker_killed_mid_run_gives_a_clear_error():
    ctx = rank_context()
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_doomed, args=(r, 3, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        assert sorted(out.get(timeout=120)[0] for _ in procs) == [0, 1, 2]
        time.sleep(1.0)
        procs[2].kill()  # SIGKILL
        errors = [out.get(timeout=30) for _ in range(2)]
        for _, message, waited in errors:
            # each survivor's error names the peer it lost and the message it was waiting for
            # (the second may learn of the failure from the first one stopping)
            assert "peer rank" in message and "message" in message, message
            assert waited < 10  # within the deadline (5 s) and then some
        assert any("peer rank 2" in m for _, m, _ in errors), errors
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_layout_of_a_bucket_follows_forward_order_and_sizes(endpoints):
    """What a DDP bucket's packets are tagged from: each parameter's span in the flat buffer
    with its layer's priority, the layers run first forward being the most urgent."""
    ep, _ = endpoints(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))
    state = dlcp_torch.DLCPState(ep, "ps", workers=[0], server_rank=1, model=model,
                                 policy=Policy(num_priorities=2, priority_map=(0, 1)))
    model(torch.zeros(1, 8))  # records the forward order
    params = list(model.parameters())[::-1]  # DDP buckets hold them in backward order
    lay = state.layout_of(params)
    assert lay.total == sum(p.numel() for p in params)
    assert lay.starts.tolist() == [0, 4, 4 + 1200, 4 + 1200 + 300]
    assert lay.priorities.tolist() == [0, 0, 1, 1]  # the second Linear is the less urgent
    prio, layers = lay.packet_tags(357)  # elements per packet at MTU 1500
    assert prio[:3].tolist() == [0, 0, 0]  # elements 0..1070: the output layer only
    assert prio[3] == 1 and layers[3] == 0  # elements 1071..1427 reach into the input layer: urgent


def test_init_without_a_rendezvous_environment_says_how_to_run(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set: run under torchrun"):
        dlcp_torch.init("ring")


def test_a_taken_store_port_names_dlcp_store_port(monkeypatch):
    import socket

    from dlcp_torch.launch import peers_from_env

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("DLCP_STORE_PORT", str(busy.getsockname()[1]))
    try:
        with pytest.raises(RuntimeError, match="DLCP_STORE_PORT"):
            peers_from_env(0, 2, with_server=False, timeout=2)
    finally:
        busy.close()


def test_ddp_without_a_process_group_names_the_call_that_makes_one():
    """``session.ddp(model)`` before ``init_process_group``: DDP would fail with torch's "Default
    process group has not been initialized"; the session says which call is missing."""
    assert not dist.is_initialized()
    session = dlcp_torch.DLCPSession(state=None, endpoint=None)  # type: ignore[arg-type]  # fails before using them
    with pytest.raises(RuntimeError, match=r"init_process_group\('gloo'\)"):
        session.ddp(torch.nn.Linear(2, 2))


def test_make_demos_comparison_keeps_its_table_for_dlcp_report(tmp_path, capsys):
    """``--compare --out FILE``: the four rows (lossless, reliable, bounded, bounded with error
    feedback) kept with the command, and ``dlcp report FILE`` prints them for the results page."""
    pytest.importorskip("sklearn")
    from dlcp.cli import main as dlcp
    from dlcp_torch.workloads.digits import WORKLOAD
    from dlcp_torch.workloads.script import main

    out = tmp_path / "demo.json"
    main(WORKLOAD, None, ["--workers", "2", "--compare", "--steps", "20", "--out", str(out)])
    capsys.readouterr()
    assert dlcp(["report", str(out)]) == 0
    report = capsys.readouterr().out
    assert "digits" in report and "| configuration | accuracy |" in report
    for config in ("lossless, p = 0", "5% loss, p = 0 (reliable)", "5% loss, p = 0.1", "5% loss, p = 0.1, EF"):
        assert f"| {config} | 0." in report, config
