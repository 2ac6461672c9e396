"""The ``dlcp`` torch.distributed backend with real processes on loopback: an unchanged DDP
script with only the backend name changed, collectives against their definition, FSDP."""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dlcp.hostagent import wire
from dlcp.hostagent.loopback import free_tcp_ports
from tests.shim.ranks import rank_context

STEPS = 6


def _spawn(fn, world: int, *args) -> dict:
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes; their results by rank."""
    (port,) = free_tcp_ports(1)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    for _ in range(world):
        try:
            rank, ok, value = q.get(timeout=240)
        except Exception:  # queue.Empty: name who never answered rather than hang
            silent = sorted(set(range(world)) - set(out))
            for p in procs:
                p.kill()
            pytest.fail(f"ranks {silent} gave no result within 240 s (exit codes {[p.exitcode for p in procs]})")
        if not ok:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank}: {value}")
        out[rank] = value
    for p in procs:
        p.join(60)
    return out


def _plain(value):
    """Tensors as numpy arrays (a tensor through a queue is shared by a file descriptor that
    goes with the process), dtypes numpy lacks as float32."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy(), str(t.dtype)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _t(plain) -> torch.Tensor:
    arr, dtype = plain
    t = torch.from_numpy(arr)
    return t.to(torch.bfloat16) if dtype == "torch.bfloat16" else t


def _entry(fn, rank, world, port, q, *args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        q.put((rank, True, _plain(fn(rank, world, *args))))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ddp_script(rank, world, backend, bound=None):
    """A plain DDP training script: only ``backend`` differs between the runs compared."""
    if bound is not None:
        os.environ["DLCP_LOSS_BOUND"] = str(bound)
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_an_unchanged_ddp_script_trains_through_dlcp_as_through_gloo():
    gloo = _spawn(_ddp_script, 3, "gloo")
    ours = _spawn(_ddp_script, 3, "dlcp", 0.0)
    for rank in range(3):
        for a, b in zip(gloo[rank], ours[rank]):
            torch.testing.assert_close(_t(b), _t(a), rtol=1e-5, atol=1e-5)
        for a, b in zip(ours[0], ours[rank]):  # every replica the same
            torch.testing.assert_close(_t(b), _t(a), rtol=0, atol=0)


def _ddp_bounds(rank, world):
    """DDP steps of a model DDP cuts into four buckets (from its second step: the first has one
    bucket of up to 1 MB), then the loss bounds and priorities of the ring messages sent."""
    os.environ["DLCP_LOSS_BOUND"] = "0.05"
    dist.init_process_group("dlcp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        ddp(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    from dlcp_torch.backend import implementation

    pg = implementation(dist.group.WORLD)
    assert pg is not None
    sent = [m for m in pg.endpoint.message_log if m.direction == "send"]
    return params, sorted({m.loss_bound for m in sent}), sorted({m.priority for m in sent})


def test_ddp_gradients_go_under_the_loss_bound_and_replicas_stay_equal():
    """With the default bound the gradients may lose a little, but the all-gather is reliable:
    every replica ends with the same parameters. The buckets' sums ran on the ring under the
    bound (an op compared by type once sent them all through the reliable gather), tagged
    with more than one priority (their order in the backward pass)."""
    ours = _spawn(_ddp_bounds, 2)
    for a, b in zip(ours[0][0], ours[1][0]):
        torch.testing.assert_close(_t(b), _t(a), rtol=0, atol=0)
    for _, bounds, priorities in ours.values():
        assert 0.05 in bounds, bounds
        assert len(priorities) > 1, priorities


def _collectives(rank, world):
    dist.init_process_group("dlcp")
    assert dist.get_backend() == "dlcp"
    out = {}
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    out["sum"] = x
    m = torch.tensor([rank * 3 - 1], dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max_int"] = m
    h = torch.full((7,), float(rank), dtype=torch.float16)
    dist.all_reduce(h)
    out["sum_f16"] = h
    bf = torch.full((5,), 0.25 * (rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(bf, op=dist.ReduceOp.AVG)
    out["avg_bf16"] = bf
    d = torch.full((3,), 1e-12 * (rank + 1), dtype=torch.float64)
    dist.all_reduce(d)
    out["sum_f64"] = d
    b = torch.tensor([rank, 7, 9], dtype=torch.int32) if rank == 1 else torch.zeros(3, dtype=torch.int32)
    dist.broadcast(b, src=1)
    out["bcast"] = b
    parts = [torch.empty(3, dtype=torch.bfloat16) for _ in range(world)]
    dist.all_gather(parts, torch.full((3,), rank + 0.5, dtype=torch.bfloat16))
    out["gather"] = torch.stack(parts)
    rs = torch.empty(4)
    dist.reduce_scatter(rs, [torch.full((4,), float(rank * 10 + r)) for r in range(world)])
    out["rs"] = rs
    if rank == 0:
        dist.send(torch.tensor([1.5, 2.5]), dst=1, tag=3)
        dist.send(torch.tensor([True, False, True]), dst=1, tag=3)
    elif rank == 1:
        a, c = torch.empty(2), torch.empty(3, dtype=torch.bool)
        dist.recv(a, src=0, tag=3)
        dist.recv(c, src=0, tag=3)
        out["p2p"] = (a, c)
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    from dlcp_torch.backend import DIRECT_SUM_BYTES, implementation

    pg = implementation(dist.group.WORLD)
    assert pg is not None
    log = pg.endpoint.message_log
    for name, elems in (("direct", DIRECT_SUM_BYTES // 4), ("ring", DIRECT_SUM_BYTES // 4 + 1)):
        pg._settle_all(60)  # (the log records a send once answered: a one-round call's come after it)
        before = sum(m.direction == "send" for m in log)
        x = torch.full((elems,), float(rank + 1))
        dist.all_reduce(x)
        pg._settle_all(60)
        out[name] = (x.min().item(), x.max().item(), sum(m.direction == "send" for m in log) - before)
    dist.barrier()
    return out


def _collectives_staged(rank, world):
    """The same calls with every tensor forced through host staging, as a CUDA tensor goes
    (:mod:`dlcp_torch.staging`; no GPU here, so CPU tensors take the path)."""
    from dlcp_torch.backend import configure
    from dlcp_torch.staging import HostCopies

    configure(copies=HostCopies(always=True))
    return _collectives(rank, world)


@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
def test_collectives_give_what_they_define(staged):
    world = 3
    res = _spawn(_collectives_staged if staged else _collectives, world)
    for rank, plain in res.items():
        # up to DIRECT_SUM_BYTES a sum is one round (a message to each other rank), above it the
        # ring's 2 (n - 1) steps; both sum exactly
        assert plain["direct"] == (6.0, 6.0, world - 1), plain["direct"]
        assert plain["ring"] == (6.0, 6.0, 2 * (world - 1)), plain["ring"]
        out = {k: _t(v) for k, v in plain.items() if k not in ("p2p", "direct", "ring")}
        torch.testing.assert_close(out["sum"], torch.arange(10, dtype=torch.float32) * 6)
        assert out["max_int"].item() == (world - 1) * 3 - 1
        torch.testing.assert_close(out["sum_f16"], torch.full((7,), 3.0, dtype=torch.float16))
        assert out["bcast"].tolist() == [1, 7, 9]
        torch.testing.assert_close(out["avg_bf16"], torch.full((5,), 0.5, dtype=torch.bfloat16))
        assert out["sum_f64"].dtype == torch.float64
        torch.testing.assert_close(out["sum_f64"], torch.full((3,), 6e-12, dtype=torch.float64), rtol=1e-15, atol=0)
        torch.testing.assert_close(out["gather"], torch.stack([torch.full((3,), r + 0.5, dtype=torch.bfloat16)
                                                               for r in range(world)]))
        torch.testing.assert_close(out["rs"], torch.full((4,), float(sum(r * 10 + rank for r in range(world)))))
    a, c = (_t(x) for x in res[1]["p2p"])
    assert a.tolist() == [1.5, 2.5] and c.tolist() == [True, False, True]


def _unsettled(rank, world):
    """A one-round collective returns without waiting for its own sends' answers
    (``_settle_later``); a send that fails after it returned fails the group, and the next call
    raises it. The failure is made by hand (a send kept so cannot be made to fail on cue):
    every rank fails one, so no rank waits on another that stopped."""
    import numpy as np

    from dlcp.hostagent.messages import SendHandle, TransportError
    from dlcp_torch.backend import implementation

    dist.init_process_group("dlcp")
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    pg = implementation(dist.group.WORLD)
    assert pg is not None
    late = SendHandle(1 - rank, 999_999)
    pg._settle_later([(late, np.zeros(1))])
    late._fail(TransportError("no answer from the receiver"))
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as exc:
        return x.tolist(), str(exc)
    return x.tolist(), "returned"


def test_a_send_that_fails_after_its_one_round_collective_returned_fails_the_next_call():
    for summed, error in _spawn(_unsettled, 2).values():
        assert summed == [3.0] * 4
        assert "failed after its collective returned" in error and "no answer from the receiver" in error, error


def _refuses(rank, world):
    dist.init_process_group("dlcp")
    try:
        dist.recv(torch.empty(1))  # from any source
    except (NotImplementedError, RuntimeError) as exc:
        return str(exc)
    return "accepted"


def test_a_receive_from_any_source_is_refused_by_name():
    res = _spawn(_refuses, 2)
    assert all("any source" in msg for msg in res.values())


def _fsdp_script(rank, world, backend):
    """FSDP (one unit per linear layer) on the CPU: parameters all-gathered, gradients
    reduce-scattered, through ``backend``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ["DLCP_LOSS_BOUND"] = "0"
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    fsdp = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(fsdp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_fsdp_trains_through_the_backend_as_through_gloo():
    gloo = _spawn(_fsdp_script, 2, "gloo")
    ours = _spawn(_fsdp_script, 2, "dlcp")
    for rank in range(2):
        assert ours[rank] == pytest.approx(gloo[rank], rel=1e-5, abs=1e-6)


def _digits(rank, world, dtype_name, seed):
    """The digits example's model, data and settings, trained with DDP over the dlcp backend
    (default loss bound) in ``dtype_name``; the test accuracy (evaluated in float32)."""
    from dlcp_torch.workloads import get_workload
    from dlcp_torch.workloads.base import accuracy

    dist.init_process_group("dlcp")
    wl = get_workload("digits")
    (x, y), (xt, yt) = wl.load_data()
    dtype = getattr(torch, dtype_name)
    model = wl.make_model(seed).to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt, _ = wl.make_optimizer(ddp.parameters(), wl.lr, wl.steps)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(wl.steps):
        idx = torch.randint(0, len(y), (wl.batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[idx].to(dtype)).float(), y[idx]).backward()
        opt.step()
    return accuracy(model.float(), xt, yt)


_FLOAT32_ACCURACY: list[float] = []


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_precision_gradients_train_digits_as_well_as_float32(dtype_name):
    """bfloat16 and float16 gradients through the backend (summed in their own type, under the default
    bound): the digits example's accuracy within the spread float32 shows over seeds."""
    pytest.importorskip("sklearn", reason="needs scikit-learn (pip install -e '.[digits]')")
    if not _FLOAT32_ACCURACY:  # shared by both dtypes' runs
        _FLOAT32_ACCURACY.extend(_spawn(_digits, 2, "float32", s)[0] for s in (1, 2))
    f32 = _FLOAT32_ACCURACY
    half = [_spawn(_digits, 2, dtype_name, s)[0] for s in (1, 2)]
    spread = max(f32) - min(f32)
    assert min(half) >= min(f32) - max(0.02, spread), (dtype_name, half, f32)


def _python_group(rank, world):
    os.environ["DLCP_C10D_BACKEND"] = "0"  # as where the c10d backend cannot be compiled
    dist.init_process_group("dlcp")
    from dlcp_torch import c10d_backend
    from dlcp_torch.backend import DLCPProcessGroup

    x = torch.ones(3) * (rank + 1)
    dist.all_reduce(x)
    return {"python_group": isinstance(dist.group.WORLD, DLCPProcessGroup), "why": c10d_backend.why_not(),
            "sum": x.tolist()}


def test_where_the_c10d_backend_cannot_be_built_the_group_runs_as_a_python_process_group():
    for res in _spawn(_python_group, 2).values():
        assert res == {"python_group": True, "why": "DLCP_C10D_BACKEND=0", "sum": [3.0, 3.0, 3.0]}


def _stats(rank, world, c10d):
    os.environ["DLCP_C10D_BACKEND"] = "1" if c10d else "0"
    dist.init_process_group("dlcp")
    from dlcp_torch.backend import group_stats

    pair = dist.new_group([0, 1])  # a second group: figures of its own
    gloo = dist.new_group(backend="gloo")
    for _ in range(3):
        dist.all_reduce(torch.ones(1000))
    dist.broadcast(torch.ones(4), src=0)
    dist.all_reduce(torch.ones(10), group=pair)
    try:
        group_stats(gloo)
        refused = "accepted"
    except ValueError as exc:
        refused = str(exc)
    # A one-round sum returns once the other rank's tensor is here, before its own send need
    # have left (it goes from a copy); the other rank reaches this barrier (gloo's: DLCP's
    # figures stay as they are) only after that send arrived, so after it they count it.
    dist.barrier(group=gloo)
    world_stats, pair_stats = group_stats(), group_stats(pair)
    dist.barrier()
    from dlcp_torch.backend import implementation

    ports = [impl.endpoint.config.peers[rank].data_port
             for impl in (implementation(dist.group.WORLD), implementation(pair)) if impl is not None]
    return {"world": world_stats["collectives"], "pair": pair_stats["collectives"],
            "broken": world_stats["broken"], "sent": world_stats["endpoint"]["data_bytes_sent"],
            "pair_sent": pair_stats["endpoint"]["data_bytes_sent"], "refused": refused, "data_ports": ports}


@pytest.mark.parametrize("c10d", [True, False], ids=["c10d", "python"])
def test_group_stats_count_each_groups_collectives_and_refuse_a_group_not_dlcps(c10d):
    results = _spawn(_stats, 2, c10d)
    for res in results.values():
        assert res["world"] == {"all_reduce": 3, "broadcast": 1}
        assert res["pair"] == {"all_reduce": 1}
        assert not res["broken"]
        assert res["sent"] >= 3 * 1000 * 4 // 2  # a ring sends half of each all_reduce at least
        assert 0 < res["pair_sent"] < res["sent"]
        assert res["refused"].startswith("not a dlcp process group")
    # every group's data reaches it on a port DLCP's switches parse as DLCP, each its own
    ports = [p for res in results.values() for p in res["data_ports"]]
    assert len(ports) == 4 and len(set(ports)) == 4 and all(wire.is_dlcp_port(p) for p in ports), ports


def _p2p_batch(rank, world):
    """A ring shift with ``batch_isend_irecv`` (pipeline parallelism's call), then ``isend`` /
    ``irecv`` with their works waited out of order."""
    dist.init_process_group("dlcp")
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(5)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank)), nxt),
                                    dist.P2POp(dist.irecv, got, prv)])
    for w in works:
        w.wait()
    a, b = torch.empty(2), torch.empty(3, dtype=torch.int64)
    recvs = [dist.irecv(a, src=prv, tag=1), dist.irecv(b, src=prv, tag=2)]
    sends = [dist.isend(torch.tensor([rank, rank], dtype=torch.float32), dst=nxt, tag=1),
             dist.isend(torch.arange(3) + rank, dst=nxt, tag=2)]
    for pending in reversed(recvs + sends):
        assert pending is not None  # (torch types isend/irecv as maybe None: for ranks outside the group)
        pending.wait()
    return {"got": got.tolist(), "a": a.tolist(), "b": b.tolist()}


def test_batch_isend_irecv_and_out_of_order_waits_deliver_to_each_receiver():
    world = 3
    for rank, res in _spawn(_p2p_batch, world).items():
        prv = (rank - 1) % world
        assert res == {"got": [float(prv)] * 5, "a": [float(prv)] * 2, "b": [prv, prv + 1, prv + 2]}


def _mtus_differ(rank, world):
    """Ranks whose MTUs differ (a jumbo-frame host beside a 1500-byte one): the sum of a tensor
    of several packets at either MTU, and the MTU the endpoint ended with."""
    os.environ["DLCP_MTU"] = "9000" if rank == 0 else "1500"
    dist.init_process_group("dlcp")
    from dlcp_torch.backend import implementation

    x = torch.arange(100_000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    pg = implementation(dist.group.WORLD)
    assert pg is not None
    return x, pg.endpoint.config.mtu


def test_ranks_with_different_mtus_all_use_the_smallest():
    """Before, each rank cut packets by its own MTU and the first collective failed (the
    receiver refused packets cut otherwise); now the ranks agree on the smallest at start-up."""
    out = _spawn(_mtus_differ, 2)
    want = torch.arange(100_000, dtype=torch.float32) * 3
    for rank in (0, 1):
        x, mtu = out[rank]
        assert mtu == 1500
        torch.testing.assert_close(_t(x), want)


def test_the_compiled_backend_is_kept_apart_per_checkout_and_python(tmp_path, monkeypatch):
    """Two checkouts (or venvs) with the same torch must not share the extension's build
    directory: ninja rebuilt it whenever the other had used it last (its command names the
    source's path and the include directories), about 25 s at every first use."""
    from dlcp_torch import c10d_backend

    monkeypatch.setenv("DLCP_C10D_CACHE", str(tmp_path / "cache"))
    here = c10d_backend.cache_dir()
    assert here == c10d_backend.cache_dir()  # stable for one checkout
    other = tmp_path / "other-checkout" / "forwarding_backend.cc"
    other.parent.mkdir()
    other.write_bytes(c10d_backend.SOURCE.read_bytes())  # the same source, elsewhere
    monkeypatch.setattr(c10d_backend, "SOURCE", other)
    assert c10d_backend.cache_dir() != here
    monkeypatch.setattr("sys.prefix", "/another/venv")
    assert len({c10d_backend.cache_dir(), here}) == 2


def _compiled_ddp(rank, world, c10d):
    """Three DDP steps of a torch.compile'd model and of the same model uncompiled (lossless)."""
    os.environ.update(DLCP_LOSS_BOUND="0", DLCP_C10D_BACKEND="1" if c10d else "0")
    dist.init_process_group("dlcp")
    grads = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        run = torch.compile(ddp, backend="eager") if compiled else ddp
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):  # the second step rebuilds DDP's buckets: a broadcast from the reducer
            run(torch.randn(8, 16, generator=g)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return grads


@pytest.mark.parametrize("c10d", [True, False], ids=["c10d", "python"])
def test_a_compiled_ddp_model_trains_as_the_same_model_uncompiled(c10d):
    """torch.compile ran DDP's bucket rebuild (a broadcast torch's C++ calls back into our
    Python) eagerly after a graph break, and Dynamo tried to compile the backend's method: the
    second step failed (``Member '_world' is not registered``). Entry points now run uncompiled."""
    for compiled, plain in _spawn(_compiled_ddp, 2, c10d).values():
        assert len(compiled) == len(plain) == 4  # every parameter has its gradient
        for a, b in zip(compiled, plain):
            torch.testing.assert_close(_t(a), _t(b), rtol=0, atol=0)


def test_every_method_torch_calls_on_a_group_or_work_is_kept_out_of_compile():
    """The entry points named in forwarding_backend.cc are the ones kept out of torch.compile."""
    import re
    from pathlib import Path

    from dlcp_torch import backend, work
    from dlcp_torch.uncompiled import kept_out

    cc = (Path(backend.__file__).parent / "csrc" / "forwarding_backend.cc").read_text()
    assert set(re.findall(r'\bcall(?:_void)?\("(\w+)"', cc)) == set(backend.ENTRY_POINTS)
    asked = {a or b for a, b in re.findall(r'\bask\("(\w+)"\)|py_\.attr\("(\w+)"\)', cc)}
    assert asked <= set(work.ENTRY_POINTS), asked - set(work.ENTRY_POINTS)
    for cls, names in ((backend.DLCPProcessGroup, backend.ENTRY_POINTS), (work.DLCPWork, work.ENTRY_POINTS)):
        for name in names:
            assert kept_out(getattr(cls, name)), f"{cls.__name__}.{name} would be compiled"


def _zero_with_uneven_inputs(rank, world, backend):
    """DDP with ZeroRedundancyOptimizer under Join, each rank with its own number of batches."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    os.environ["DLCP_LOSS_BOUND"] = "0"
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with Join([ddp, opt]):
        for _ in range(3 + 2 * rank):
            opt.zero_grad()
            ddp(torch.randn(8, 16, generator=g)).sum().backward()
            opt.step()
    opt.consolidate_state_dict(to=0)
    return [p.detach().clone() for p in model.parameters()]


def test_zero_with_uneven_inputs_trains_as_through_gloo():
    """ZeroRedundancyOptimizer's broadcasts and Join's shadow all_reduces for ranks that ran out
    of batches: the parameters gloo gives, on every rank."""
    gloo = _spawn(_zero_with_uneven_inputs, 3, "gloo")
    ours = _spawn(_zero_with_uneven_inputs, 3, "dlcp")
    for rank in range(3):
        for a, b in zip(gloo[rank], ours[rank]):
            torch.testing.assert_close(_t(b), _t(a), rtol=1e-6, atol=1e-6)


def test_a_group_larger_than_the_ring_allows_is_refused_before_any_port_is_taken():
    import datetime

    from dlcp_torch.backend import MAX_GROUP_SIZE, create_process_group

    assert MAX_GROUP_SIZE == 32  # 2 (n - 1) ring steps below the point-to-point step, 63
    store = dist.HashStore()
    with pytest.raises(ValueError, match=r"a group of 33 ranks; at most 32"):
        create_process_group(store, 0, MAX_GROUP_SIZE + 1, datetime.timedelta(seconds=5))
    assert not store.check(["dlcp/0/formed"])  # nothing written: it refused first


def _many_tensors(rank, world):
    import warnings

    dist.init_process_group("dlcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (all_reduce_coalesced is deprecated)
        try:
            dist.all_reduce_coalesced([torch.ones(1) for _ in range(4097)])
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        many = [torch.ones(1) for _ in range(4096)]
        dist.all_reduce_coalesced(many)
    return refused, float(many[-1][0])


def test_a_call_naming_more_tensors_than_the_tensor_field_holds_is_refused_and_the_group_goes_on():
    for refused, last in _spawn(_many_tensors, 2).values():
        assert "all_reduce of 4097 tensors; at most 4096 in one call" in refused, refused
        assert last == 2.0  # the group goes on: 4,096 is fine
