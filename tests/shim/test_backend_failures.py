"""The ``dlcp`` backend fails the way gloo fails: bad calls raise at the call, a killed or
stopped rank makes every survivor raise (at once, or by the group's timeout), never a hang or
a crash; barriers never hang. Real processes on loopback."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dlcp.hostagent.loopback import free_tcp_ports
from tests.shim.test_backend import _spawn
from tests.shim.ranks import rank_context


def _drill_entry(fn, rank, world, port, q, timeout_s, *args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import dlcp_torch.backend  # noqa: F401  (registers "dlcp")

    dist.init_process_group("dlcp", timeout=datetime.timedelta(seconds=timeout_s))
    t0 = time.monotonic()
    try:
        fn(rank, world, *args)
        q.put((rank, "finished", time.monotonic() - t0, ""))
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        q.put((rank, type(exc).__name__, time.monotonic() - t0, str(exc)[:400]))
    dist.destroy_process_group()


def _drill(fn, world: int, timeout_s: float, victim: int, *args) -> tuple[dict, dict]:
    """Run ``fn`` in ``world`` processes; every rank but ``victim`` (-1: none) reports what it
    raised and when. Returns (reports by rank, exit codes by rank)."""
    (port,) = free_tcp_ports(1)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_drill_entry, args=(fn, r, world, port, q, timeout_s, *args)) for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, tuple] = {}
    try:
        for _ in range(world - (0 <= victim < world)):
            rank, kind, after, msg = q.get(timeout=timeout_s + 120)
            reports[rank] = (kind, after, msg)
        for r, p in enumerate(procs):
            if r != victim:
                p.join(60)
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(10)
    return reports, {r: p.exitcode for r, p in enumerate(procs)}


def _ddp_then(rank, world, victim, sig):
    """DDP steps; at step 3 ``victim`` sends itself ``sig``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    for step in range(40):
        if step == 3 and rank == victim:
            os.kill(os.getpid(), sig)
        ddp(torch.randn(16, 64)).sum().backward()


def _async_then_destroy(rank, world):
    """24 all_reduces issued async (rank 1 half a second after rank 0), then
    destroy_process_group() without waiting for them; then their works."""
    dist.init_process_group("dlcp")
    ts = [torch.ones(200_000 * (1 + i % 3)) * (rank + 1) for i in range(24)]
    if rank == 1:
        time.sleep(0.5)
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    dist.destroy_process_group()
    errors = []
    for w in works:
        try:
            w.wait()
        except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
            errors.append(str(exc)[:200])
    return errors, sorted({float(t[0]) for t in ts})


def test_collectives_issued_before_destroy_finish_as_gloos_do():
    """gloo's group finishes the collectives queued when it is destroyed; the leave closed the
    endpoint under those not yet run (12 of 24 failed)."""
    for rank, (errors, sums) in _spawn(_async_then_destroy, 2).items():
        assert errors == [], (rank, errors)
        assert sums == [3.0], (rank, sums)


def _different_collectives(rank, world, numel):
    """Rank 0 calls all_reduce where rank 1 calls broadcast from rank 0, or all_gather: the same
    size, the same point of the program (collective #1), a bug."""
    if rank == 0:
        dist.all_reduce(torch.ones(numel))
    elif numel <= 16:
        dist.broadcast(torch.ones(numel), src=0)
    else:
        dist.all_gather([torch.empty(numel) for _ in range(world)], torch.ones(numel))


@pytest.mark.parametrize("numel", [4, 1_000_000], ids=["one-round", "ring"])
def test_ranks_in_different_collectives_raise_at_once_naming_both(numel):
    """Rank 1's broadcast took rank 0's one-round all_reduce part as its data and returned,
    while rank 0 waited for rank 1's part until the timeout (gloo's ranks both wait for it).
    Each message now names its collective's kind, and a rank probed for a collective of
    another kind under a number it issued fails the group at once, naming both (either rank may
    find it first, as the guide says)."""
    timeout_s = 60.0
    reports, _ = _drill(_different_collectives, 2, timeout_s, -1, numel)
    other = "broadcast" if numel <= 16 else "all_gather"
    for rank in (0, 1):
        kind, after, msg = reports[rank]
        assert kind == "DistBackendError", (rank, kind, msg)
        assert after < 10, (rank, after, msg)  # not the timeout
    # the rank that finds it (its peer's probe came first; the other then sees its connection
    # close) names both, each from where it stands
    called = {0: "all_reduce", 1: other}
    assert any(f"rank {1 - r} called {called[1 - r]} as collective #1 where rank {r} called {called[r]}"
               in reports[r][2] for r in (0, 1)), reports


def _ddp_then_a_bug(rank, world, victim):
    """DDP steps; at step 3 ``victim``'s script raises (a bug, not a failure of the group) and
    leaves the group while the others wait in the step's all_reduce."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(40):
        if step == 3 and rank == victim:
            raise ValueError("a bug in the victim's script")
        ddp(torch.randn(16, 64)).sum().backward()


def test_a_rank_whose_script_raises_makes_every_survivor_raise_at_once():
    """The raising rank leaves (destroy_process_group) while the others wait for its data; it
    waited for their word the whole leave (60 s) and they raised only then (gloo's: 0.5 s). A
    peer probing a message it never posted now makes it leave at once."""
    world, victim, timeout_s = 3, 1, 120.0
    reports, codes = _drill(_ddp_then_a_bug, world, timeout_s, -1, victim)
    assert reports[victim][0] == "ValueError", reports[victim]
    for rank in (0, 2):
        kind, after, msg = reports[rank]
        assert kind in ("DistBackendError", "RuntimeError"), (rank, kind, msg)
        assert "rank 1" in msg, msg
        assert after < 20, (rank, after)  # (LEAVE_WAIT is 60 s)
    assert all(code == 0 for code in codes.values()), codes


def test_a_killed_rank_makes_every_survivor_raise_at_once_and_none_crash():
    world, victim, timeout_s = 3, 1, 60.0
    reports, codes = _drill(_ddp_then, world, timeout_s, victim, victim, signal.SIGKILL)
    for rank in (0, 2):
        kind, after, msg = reports[rank]
        assert kind in ("DistBackendError", "RuntimeError"), (rank, kind, msg)
        assert "lost rank 1" in msg or "rank 1" in msg, msg
        assert after < timeout_s, (rank, after)  # the connection closing says it, not the timeout
        assert codes[rank] == 0, (rank, codes)  # raised, destroyed the group, exited: no crash


def test_a_stopped_rank_makes_every_survivor_raise_by_the_groups_timeout():
    world, victim, timeout_s = 2, 1, 8.0
    reports, codes = _drill(_ddp_then, world, timeout_s, victim, victim, signal.SIGSTOP)
    kind, after, msg = reports[0]
    assert kind in ("DistBackendError", "RuntimeError") and "timed out" in msg, (kind, msg)
    assert after < timeout_s + 5 + 5, after  # (+ the three steps before the stop, on a busy machine)
    assert codes[0] == 0


def _bad_calls(rank, world):
    dist.init_process_group("dlcp")
    refused: dict[str, object] = {}
    calls = {
        "uint16 sum": lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16)),
        "float8 sum": lambda: dist.all_reduce(torch.zeros(4, dtype=torch.float8_e4m3fn)),
        "premul sum": lambda: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0)),
        "band float": lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),
        "avg int64": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.AVG),  # (gloo: too)
        "all_gather list": lambda: dist.all_gather([torch.zeros(3)], torch.zeros(3)),
        "all_gather size": lambda: dist.all_gather([torch.zeros(3), torch.zeros(4)], torch.zeros(3)),
        "scatter tensor size": lambda: dist.reduce_scatter_tensor(torch.zeros(3), torch.zeros(7)),
        "all_to_all_single split": lambda: dist.all_to_all_single(torch.zeros(4), torch.zeros(4), [1, 2], [2, 2]),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            refused[name] = "accepted"
        except (ValueError, RuntimeError) as exc:
            # (our refusals are both, so a gloo script's `except RuntimeError` catches them)
            both = isinstance(exc, ValueError) and isinstance(exc, RuntimeError)
            refused[name] = (str(exc), time.monotonic() - t0, both)
    x = torch.ones(3) * (rank + 1)
    dist.all_reduce(x)  # the group still works
    refused["after"] = x.tolist()
    return refused


def test_bad_calls_raise_at_the_call_naming_what_and_the_group_goes_on():
    res = _spawn(_bad_calls, 2)
    for rank, refused in res.items():
        assert refused.pop("after") == [3.0, 3.0, 3.0]
        for name, got in refused.items():
            assert got != "accepted", (rank, name)
            msg, after, both = got
            assert "dlcp backend" in msg or "dlcp" in msg, (name, msg)
            assert both, (name, msg)
            assert after < 1.0, (name, after)


def _bool_and_complex(rank, world):
    """Reductions gloo gives for bool (SUM any, PRODUCT all) and complex tensors (SUM, AVG of the
    real and imaginary parts), small (one round) and large (the ring)."""
    dist.init_process_group("dlcp")
    out: dict[str, object] = {}
    for op in ("SUM", "PRODUCT", "MAX", "MIN"):
        b = torch.tensor([True, False, rank == 1, rank == 0])
        dist.all_reduce(b, op=getattr(dist.ReduceOp, op))
        out[f"bool {op}"] = b.tolist()
    small = torch.tensor([1 + 1j, 2 - 1j]) * (rank + 1)
    dist.all_reduce(small)
    out["complex64 sum"] = small.tolist()
    big = torch.full((300_000,), 1 + 2j, dtype=torch.complex64) * (rank + 1)
    dist.all_reduce(big, op=dist.ReduceOp.AVG)
    out["complex64 avg, large"] = bool((big == (1.5 + 3j)).all())
    part = torch.empty(1, dtype=torch.complex128)
    dist.reduce_scatter_tensor(part, torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex128) * (rank + 1))
    out["complex128 reduce_scatter"] = part.tolist()
    return out


def test_bool_and_complex_tensors_reduce_as_through_gloo():
    """Refused before ("reduce op SUM does not apply to torch.bool tensors", and to complex64),
    where gloo reduces them; the values are gloo's (checked against it by hand, 2 ranks)."""
    for rank, out in _spawn(_bool_and_complex, 2).items():
        assert out == {"bool SUM": [True, False, True, True], "bool PRODUCT": [True, False, False, False],
                       "bool MAX": [True, False, True, True], "bool MIN": [True, False, False, False],
                       "complex64 sum": [3 + 3j, 6 - 3j], "complex64 avg, large": True,
                       "complex128 reduce_scatter": [[3 + 3j], [6 - 3j]][rank]}, rank


def _mismatched(rank, world, case):
    """Each rank calls the same collective with a tensor of its own size (or type)."""
    if case == "all_reduce":
        dist.all_reduce(torch.ones(1000 if rank == 0 else 400))
    elif case == "dtype":
        dist.all_reduce(torch.ones(100, dtype=torch.float32 if rank == 0 else torch.float64))
    elif rank == 0:  # send 10 elements into a receive of 4
        dist.send(torch.ones(10), 1)
    else:
        dist.recv(torch.zeros(4), 0)


@pytest.mark.parametrize("case", ["all_reduce", "dtype", "send_recv"])
def test_tensors_that_differ_across_ranks_make_both_raise_at_once(case):
    """gloo fails at once on a size mismatch; so does dlcp (not at the group's timeout)."""
    timeout_s = 60.0
    reports, codes = _drill(_mismatched, 2, timeout_s, -1, case)
    for rank in (0, 1):
        kind, after, msg = reports[rank]
        assert kind == "DistBackendError", (rank, kind, msg)
        assert "tensors differ" in msg, msg
        mine = {"all_reduce": ["1,000 float32", "400 float32"], "dtype": ["100 float32", "100 float64"],
                "send_recv": ["10 float32", "4 float32"]}[case][rank]
        assert f"this rank's tensors: {mine}" in msg, msg  # (the wire's 2-byte counts alone misled)
        assert after < 10, (rank, after)
    assert codes == {0: 0, 1: 0}


def _barriers(rank, world, n):
    dist.init_process_group("dlcp", timeout=datetime.timedelta(seconds=60))  # (a hang fails in a minute)
    for i in range(n):
        if i % 2:
            dist.barrier(async_op=True).wait()
        else:
            dist.barrier()
    return n


def test_back_to_back_barriers_never_hang():
    """Barriers were rings over one element: empty chunks, whose sends waited for a pass that had
    ended (13 of 22 runs of a barrier loop hung). And past 1,024 calls, where message ids repeat:
    a rank ahead sent the id's next use before the other had set it up, and its packets were
    taken for stragglers of the finished use and dropped (the 1,026th barrier hung)."""
    n = 1_100
    assert _spawn(_barriers, 3, n) == {0: n, 1: n, 2: n}


def _more_collectives(rank, world):
    dist.init_process_group("dlcp")
    out = {}
    x = torch.arange(4, dtype=torch.float32) + rank
    dist.reduce(x, dst=1)
    out["reduce"] = x
    g = [torch.empty(2, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), rank, dtype=torch.int64), g, dst=0)
    out["gather"] = torch.stack(g) if g else torch.zeros(0)
    s = torch.empty(3)
    dist.scatter(s, [torch.full((3,), 10.0 * r) for r in range(world)] if rank == 2 else None, src=2)
    out["scatter"] = s
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), rank * 10.0 + r) for r in range(world)])
    out["all_to_all"] = torch.stack(outs)
    inp = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    single = torch.empty(world * 2)
    dist.all_to_all_single(single, inp)
    out["all_to_all_single"] = single
    uneven_in = torch.arange(rank + 1 + world - 1, dtype=torch.float32)  # rank sends r+1 rows to rank ... see below
    in_splits = [1] * (world - 1) + [rank + 1]
    out_splits = [r + 1 if rank == world - 1 else 1 for r in range(world)]
    uneven_out = torch.empty(sum(out_splits))
    dist.all_to_all_single(uneven_out, uneven_in, out_splits, in_splits)
    out["uneven"] = uneven_out
    return out


def test_reduce_gather_scatter_and_all_to_all_give_what_they_define():
    world = 3
    res = _spawn(_more_collectives, world)
    from tests.shim.test_backend import _t

    assert _t(res[1]["reduce"]).tolist() == (torch.arange(4.0) * 3 + 3).tolist()
    assert _t(res[0]["reduce"]).tolist() == torch.arange(4.0).tolist()  # a non-root keeps its own
    assert _t(res[0]["gather"]).tolist() == [[0, 0], [1, 1], [2, 2]]
    for rank in range(world):
        assert _t(res[rank]["scatter"]).tolist() == [10.0 * rank] * 3
        assert _t(res[rank]["all_to_all"]).tolist() == [[r * 10.0 + rank] * 2 for r in range(world)]
        want = [100 * r + 2 * rank + k for r in range(world) for k in range(2)]
        assert _t(res[rank]["all_to_all_single"]).tolist() == want
    # the last rank receives rank r's last r+1 elements; the others one element from each rank
    last = _t(res[world - 1]["uneven"]).tolist()
    assert last == [v for r in range(world) for v in range(world - 1, world + r)]
    assert _t(res[0]["uneven"]).tolist() == [0.0] * world


def _fsdp2(rank, world, backend):
    """FSDP2 over a DeviceMesh, a DTensor redistributed, a functional all_reduce: each resolves
    the group by its name."""
    from torch.distributed._functional_collectives import all_reduce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["DLCP_LOSS_BOUND"] = "0"
    dist.init_process_group(backend)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    world_group = dist.group.WORLD
    assert world_group is not None
    summed = all_reduce(torch.ones(3) * (rank + 1), "sum", world_group)
    backend = type(world_group._get_backend(torch.device("cpu"))).__name__  # a c10d Backend, as gloo's
    return {"losses": losses, "full": full.tolist(), "summed": summed.tolist(), "name": world_group.group_name,
            "backend": backend}


def test_fsdp2_device_mesh_and_dtensor_run_as_through_gloo():
    """... and the group's CPU backend is a c10d Backend (``_get_backend``), dlcp's as gloo's."""
    gloo = _spawn(_fsdp2, 2, "gloo")
    ours = _spawn(_fsdp2, 2, "dlcp")
    for rank in range(2):
        assert ours[rank]["name"]  # the group has a name torch resolves it by
        assert ours[rank]["losses"] == pytest.approx(gloo[rank]["losses"], rel=1e-5, abs=1e-6)
        assert ours[rank]["full"] == list(range(8)) and ours[rank]["summed"] == [3.0, 3.0, 3.0]
        assert (gloo[rank]["backend"], ours[rank]["backend"]) == ("ProcessGroupGloo", "ForwardingBackend")


def _one_leaves_early(rank, world):
    """Rank 0 is done after one send and destroys its group while ranks 1 and 2 still exchange."""
    dist.init_process_group("dlcp")
    x = torch.full((4,), 7.0)
    if rank == 0:
        dist.send(x, dst=1)
    elif rank == 1:
        dist.recv(x, src=0)
        dist.recv(x, src=2)
    else:
        time.sleep(2.0)
        dist.send(torch.full((4,), 9.0), dst=1)
    dist.destroy_process_group()
    return x.tolist()


def test_a_rank_that_finishes_first_does_not_fail_the_others():
    """A group leaves together: before, rank 0 closing its connections after its last call
    failed the collectives ranks 1 and 2 still had between them ("lost rank 0")."""
    res = _spawn(_one_leaves_early, 3)
    assert res[1] == [9.0] * 4


class _LateWaiter:
    """A rank's store whose waits begin ``delay`` s late, recording how they ended: the rank is
    slow to reach its leave-wait (a busy machine), as one of four often was."""

    def __init__(self, store, delay: float) -> None:
        self.store, self.delay = store, delay
        self.error: str | None = None
        self.looked: list[tuple[str, ...]] = []  # each wait's keys, in order

    def set(self, key, value):
        return self.store.set(key, value)

    def check(self, keys):
        if tuple(keys) not in self.looked:  # a new wait: it begins late
            self.looked.append(tuple(keys))
            time.sleep(self.delay)
        try:
            return self.store.check(keys)
        except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
            self.error = str(exc)[:200]
            raise


def _late_leaver(rank, world):
    from dlcp_torch.backend import implementation

    dist.init_process_group("dlcp")
    dist.all_reduce(torch.ones(4))
    late = None
    if rank == 1:
        pg = implementation(dist.group.WORLD)
        assert pg is not None
        late = _LateWaiter(pg._store, 2.0)
        pg._store = late  # type: ignore[assignment]  # it has the two methods shutdown calls
    dist.destroy_process_group()
    return None if late is None else (late.error, [list(k) for k in late.looked])


def test_the_store_hosts_rank_leaves_last():
    """Under MASTER_ADDR rank 0's process hosts the store: a rank whose leave-wait came after
    rank 0 had seen every rank's word found the store gone, and torch printed a warning with a
    C++ stack trace at exit (about one 4-rank run in ten on a busy machine)."""
    error, looked = _spawn(_late_leaver, 2)[1]
    assert error is None, error
    assert looked == [["dlcp/leaving/0", "dlcp/leaving/1"], ["dlcp/bye"]]  # every wait ran, late


def _work_states(rank, world):
    """What a caller that polls its works sees: gloo's answers (is_completed, is_success,
    exception, result), for works that succeed."""
    dist.init_process_group("dlcp")
    x = torch.ones(70_000) * (rank + 1)
    work = dist.all_reduce(x, async_op=True)
    t0 = time.monotonic()
    while not work.is_completed():  # (before the fix this loop never ended)
        assert time.monotonic() - t0 < 60, "is_completed() stayed False"
        time.sleep(0.005)
    seen = {"sum": float(x[0]), "success": work.is_success(), "exception": work.exception(),
            "result": [tuple(t.shape) for t in work.result()]}
    outs = [torch.zeros(3) for _ in range(world)]
    for name, w in (("all_gather", dist.all_gather(outs, torch.ones(3), async_op=True)),
                    ("barrier", dist.barrier(async_op=True)),
                    ("broadcast", dist.broadcast(torch.ones(2), 0, async_op=True))):
        w.wait()
        seen[name] = (w.is_completed(), [tuple(t.shape) for t in w.result()])
    got = dist.all_gather([torch.zeros(3) for _ in range(world)], torch.ones(3), async_op=True).get_future().wait()
    seen["all_gather's future"] = [tuple(t.shape) for t in got]  # (its outputs, not a list inside a list)
    # once wait() returned, the future is done too (it was not yet in about 1 call in 6)
    works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(50)]
    seen["futures not done after wait"] = sum(not (w.wait() and w.get_future().done()) for w in works)
    return seen


def test_a_work_says_it_completed_and_gives_its_result_as_gloos_do():
    """torch's Work trampoline forwards only wait() and get_future() to a Python work: a
    c10d backend's works said is_completed() False for ever and result() raised "not
    implemented"; gloo's give True and their output tensors. And a work's future is done when
    its wait() returns, as gloo's is."""
    for seen in _spawn(_work_states, 2).values():
        assert seen == {"sum": 3.0, "success": True, "exception": None, "result": [(70_000,)],
                        "all_gather": (True, [(3,), (3,)]), "barrier": (True, []), "broadcast": (True, [(2,)]),
                        "all_gather's future": [(3,), (3,)], "futures not done after wait": 0}


def _poll_while_a_peer_dies(rank, world):
    """Rank 1 leaves (without a word) while rank 0's all_reduce is in flight; rank 0 polls."""
    big = torch.ones(1 << 22)
    if rank == 1:
        dist.all_reduce(torch.ones(1))  # (the group is up on both sides)
        time.sleep(0.5)
        os._exit(0)
    dist.all_reduce(torch.ones(1))
    work = dist.all_reduce(big, async_op=True)
    t0 = time.monotonic()
    while not work.is_completed():
        assert time.monotonic() - t0 < 30, "is_completed() stayed False after the peer died"
        time.sleep(0.005)
    assert not work.is_success()
    exc = work.exception()
    assert isinstance(exc, dist.DistBackendError) and "rank 1" in str(exc), repr(exc)
    with pytest.raises(dist.DistBackendError, match="rank 1"):
        work.wait()


def test_a_failed_work_says_so_to_a_caller_that_polls():
    """is_completed() True, is_success() False and exception() the collective's error, as gloo's
    works say when a peer's connection closes (before: False, True and None for ever)."""
    reports, codes = _drill(_poll_while_a_peer_dies, 2, 60.0, 1)
    assert reports[0][0] == "finished", reports[0]
    assert codes[0] == 0


def _reinit_on_one_port(rank, world, port, cycles):
    """init, all_reduce, destroy, ``cycles`` times, on the same MASTER_PORT (rank 0 hosts the store)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import dlcp_torch.backend  # noqa: F401

    sums = []
    for _ in range(cycles):
        dist.init_process_group("dlcp", timeout=datetime.timedelta(seconds=30))
        x = torch.ones(10) * (rank + 1)
        dist.all_reduce(x)
        dist.destroy_process_group()
        sums.append(float(x[0]))
    return sums


def _reinit_entry(rank, world, port, q, cycles):
    try:
        q.put((rank, _reinit_on_one_port(rank, world, port, cycles)))
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
        q.put((rank, f"{type(exc).__name__}: {str(exc)[:300]}"))


def test_a_group_destroyed_and_made_again_on_the_same_port_forms():
    """Rank 0 hosts the store and leaves last; the others returned from destroy while its old
    store was still up, and a re-init at once reached it: with 4 ranks every re-init failed at
    the timeout (gloo's passed). They now return after rank 0's last word (``dlcp/bye``)."""
    world, cycles = 4, 3
    (port,) = free_tcp_ports(1)
    got = _reports(_reinit_entry, world, port, cycles, 180)
    assert got == {r: [10.0] * cycles for r in range(world)}, got


def _reports(target, world: int, port: int, cycles: int, timeout: float) -> dict:
    """Run ``target(rank, world, port, queue, cycles)`` in ``world`` processes; what each put
    in the queue, by rank."""
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, q, cycles)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _reinit_on_a_lasting_store(rank, world, port, q, cycles):
    """init (``store=`` a store that outlives the groups, as torchrun's agent store), all_reduce,
    destroy, ``cycles`` times; the last rank comes 1.5 s after the others to every group but the
    first, so they read the store before it has written its new address."""
    torch.set_num_threads(1)
    import dlcp_torch.backend  # noqa: F401

    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60))
        sums = []
        for cycle in range(cycles):
            if cycle and rank == world - 1:
                time.sleep(1.5)
            dist.init_process_group("dlcp", store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=30))
            x = torch.ones(10) * (rank + 1 + cycle)
            dist.all_reduce(x)
            dist.destroy_process_group()
            sums.append(float(x[0]))
        q.put((rank, sums))
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
        q.put((rank, f"{type(exc).__name__}: {str(exc)[:300]}"))


def test_a_group_made_again_on_a_store_that_outlives_it_reads_only_its_own_keys():
    """torch names the keys of a default group made again by the same name; on a store that
    outlives groups (torchrun's agent store) the others read a late rank's last address and the
    group failed. Each group's keys are now its own (``_this_groups_keys``)."""
    world, cycles = 4, 3
    (port,) = free_tcp_ports(1)
    host = dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    try:
        got = _reports(_reinit_on_a_lasting_store, world, port, cycles, 240)
    finally:
        del host
    assert got == {r: [10.0 + 4 * c for c in range(cycles)] for r in range(world)}, got


ELASTIC_SCRIPT = '''
import os, signal, sys, time, torch, torch.distributed as dist
import dlcp_torch.backend  # noqa: F401
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.set_num_threads(1)
if sys.argv[1] == "before-init" and os.environ["RANK"] == "1" and attempt == 0:
    time.sleep(1.0)  # the others have counted themselves in and wait for this one
    os.kill(os.getpid(), signal.SIGKILL)
dist.init_process_group("dlcp")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
ddp = torch.nn.parallel.DistributedDataParallel(model)
for step in range(10):
    if sys.argv[1] == "mid-ddp" and step == 3 and dist.get_rank() == 1 and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    ddp(torch.randn(16, 64)).sum().backward()
print(f"rank {dist.get_rank()} finished attempt {attempt}", flush=True)
dist.destroy_process_group()
'''


@pytest.mark.parametrize("when", ["mid-ddp", "before-init"])
def test_torchrun_restarts_the_workers_after_a_rank_dies_and_the_new_group_trains(tmp_path, when):
    """torchrun --max-restarts: rank 1 dies (mid-DDP, or before it made the group while the
    others waited in theirs), the agent restarts every worker, and they make the group again on
    the agent's store, which still held the dead group's keys (mid-DDP: it hung until torchrun's
    own timeout, or failed on the old secret; gloo's fails to connect there)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    script = tmp_path / "train.py"
    script.write_text(ELASTIC_SCRIPT)
    (port,) = free_tcp_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(torchrun), "--nproc_per_node", "3", "--max-restarts", "1", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), str(script), when], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d) finished attempt (\d)", run.stdout)) == [(str(r), "1") for r in range(3)], \
        run.stdout[-2000:]
