"""The testbed's stock-DDP agents (``dlcp.topologies.ddp_agent``) on loopback: what users run (gloo,
and DLCP through ``init_process_group("dlcp")``), started as the runner starts them, against DLCP's
agents on the same workload. No root, no switches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlcp.hostagent.loopback import free_port_pairs
from dlcp.topologies.runner import RunOptions, agent_spec, scheme_policy


def _train(tmp_path: Path, scheme: str, opts: RunOptions) -> list[dict]:
    """Run ``scheme``'s agents (gloo's, or DLCP's with a server for PS) on loopback; their records."""
    n = opts.workers
    ports = free_port_pairs(n + 1)
    spec = agent_spec(opts, scheme_policy(scheme, opts), ["127.0.0.1"] * (n + 1), ports, scheme=scheme,
                      store_port=ports[-1][0])
    d = tmp_path / scheme
    d.mkdir()
    (d / "agent.json").write_text(json.dumps(spec))
    agent = [sys.executable, "-m", "dlcp.topologies.agent", str(d / "agent.json")]
    server = (subprocess.Popen([*agent, str(n)]) if spec["transport"] == "dlcp" and opts.pattern == "ps"
              else None)
    outs = [d / f"w{r}.jsonl" for r in range(n)]
    workers = [subprocess.Popen([*agent, str(r), str(outs[r])]) for r in range(n)]
    try:
        for w in workers:
            assert w.wait(timeout=300) == 0
    finally:
        for p in [*workers, *([server] if server else [])]:
            p.terminate()
            p.wait(timeout=30)
    return [json.loads(line) for o in outs for line in o.read_text().splitlines()]


def _evals(records: list[dict]) -> dict[tuple[int, int], float]:
    return {(r["iteration"], r["rank"]): r["accuracy"] for r in records if r["kind"] in ("eval", "final")}


def test_gloo_trains_what_dlcp_trains_lossless_step_for_step(tmp_path):
    """Same model, seed, shards, batches, optimiser and evaluation points: stock DDP over gloo
    and DLCP without loss (p = 0) reach the same accuracies at every evaluation."""
    opts = RunOptions(workers=2, iterations=12, workload="digits", eval_every=4, capacity_pps=20_000, loss_bound=0.0)
    gloo = _train(tmp_path, "gloo", opts)
    dlcp = _train(tmp_path, "baseline", opts)
    assert sorted(_evals(gloo)) == sorted(_evals(dlcp)) == [(i, r) for i in (0, 4, 8, 12, 13) for r in (0, 1)]
    for key, acc in _evals(gloo).items():  # float sums in another order: at most one test sample of 360
        assert abs(acc - _evals(dlcp)[key]) <= 1 / 360 + 1e-9, key
    measured = [r for r in gloo if r["kind"] == "measured"]
    assert len(measured) == 2 * 12
    for r in measured:
        assert r["iteration_time"] >= r["sync_time"] >= 0 and r["compute_time"] >= 0
        assert abs(sum(r["breakdown"].values()) - r["iteration_time"]) < 1e-6
        assert r["lost_fraction"] == 0.0 and r["retransmissions"] >= 0


def test_the_dlcp_backend_trains_what_gloo_trains_lossless_and_reports_its_endpoint(tmp_path):
    """``dlcp-backend``: the same stock-DDP script with ``init_process_group("dlcp")``. Lossless
    (the run's policy, p = 0, reaches the backend), it reaches gloo's accuracies at every
    evaluation; its records count the endpoint's resends, and its file ends with the endpoint's
    totals as DLCP's agents' do."""
    opts = RunOptions(workers=2, iterations=12, workload="digits", eval_every=4, capacity_pps=20_000, loss_bound=0.0)
    gloo = _train(tmp_path, "gloo", opts)
    backend = _train(tmp_path, "dlcp-backend", opts)
    assert sorted(_evals(gloo)) == sorted(_evals(backend))
    for key, acc in _evals(gloo).items():  # float sums in another order: at most one test sample of 360
        assert abs(acc - _evals(backend)[key]) <= 1 / 360 + 1e-9, key
    measured = [r for r in backend if r["kind"] == "measured"]
    assert len(measured) == 2 * 12 and all(r["retransmissions"] >= 0 and r["sync_time"] >= 0 for r in measured)
    for r in measured:  # DLCP's agents' records: the breakdown from its messages, their traces
        assert abs(sum(r["breakdown"].values()) - r["iteration_time"]) < 1e-6 and r["lost_fraction"] == 0.0
        assert {row[0] for row in r["message_trace"]} == {"send", "recv"}
    endpoints = [r for r in backend if r["kind"] == "endpoint"]
    assert sorted(e["rank"] for e in endpoints) == [0, 1]
    assert all(e["stats"]["data_pkts_sent"] > 0 and e["stats"]["datapath_failure"] is None for e in endpoints)
    assert not [r for r in gloo if r["kind"] == "endpoint"]


@pytest.mark.parametrize("scheme", ["gloo-fp16", "powersgd"])
def test_pytorchs_compression_hooks_train(tmp_path, scheme):
    opts = RunOptions(workers=2, iterations=30, workload="digits", eval_every=10, capacity_pps=20_000)
    records = _train(tmp_path, scheme, opts)
    finals = [r["accuracy"] for r in records if r["kind"] == "final"]
    assert len(finals) == 2 and finals[0] == finals[1]  # replicas stay equal: both hooks all-reduce
    first = [r["accuracy"] for r in records if r["kind"] == "eval" and r["iteration"] == 0]
    # it learns (PowerSGD's rank-1 approximation more slowly than plain all-reduce: 38 % after 30 steps)
    assert finals[0] > max(0.2, first[0] + 0.1)


def test_gloo_exchanges_the_synthetic_workloads_buckets(tmp_path):
    opts = RunOptions(workers=2, iterations=2, scale=0.0005, compute_ms=20, calibration_iterations=2)
    records = _train(tmp_path, "gloo-fp16", opts)
    kinds = [r["kind"] for r in records]
    assert kinds.count("warmup") == 2 and kinds.count("measured") == 4 and kinds.count("calibration") == 4
    measured = [r for r in records if r["kind"] == "measured"]
    assert all(r["messages"] > 1 and r["compute_time"] >= 0.015 for r in measured)
    assert all(r["compute_time"] == 0.0 for r in records if r["kind"] == "calibration")
