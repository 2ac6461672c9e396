"""The testbed's training agents (``dlcp.topologies.agent``) on loopback: real PyTorch training of the
digits MLP through dlcp_torch, 2 workers + PS as separate processes with the testbed's spec,
and the time-to-accuracy trace the report builds from what they write."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from dlcp.hostagent.policy import Policy
from tests.conftest import free_port_pairs
from dlcp.topologies.report import scheme_metrics
from dlcp.topologies.runner import RunOptions, agent_spec


def test_training_agents_evaluate_together_and_give_a_time_to_accuracy_trace(tmp_path):
    opts = RunOptions(workers=2, iterations=12, workload="digits", eval_every=4, capacity_pps=20_000)
    spec = agent_spec(opts, Policy(), ["127.0.0.1"] * 3, free_port_pairs(3))
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(spec))
    server = subprocess.Popen([sys.executable, "-m", "dlcp.topologies.agent", str(path), "2"])
    outs = [tmp_path / f"w{r}.jsonl" for r in range(2)]
    workers = [subprocess.Popen([sys.executable, "-m", "dlcp.topologies.agent", str(path), str(r), str(outs[r])])
               for r in range(2)]
    try:
        for w in workers:
            assert w.wait(timeout=300) == 0
    finally:
        for p in [*workers, server]:
            p.terminate()
            p.wait(timeout=30)
    records = [json.loads(line) for o in outs for line in o.read_text().splitlines()]
    evals = sorted((r["iteration"], r["rank"]) for r in records if r["kind"] == "eval")
    # both workers evaluate after the same iterations: 0 (warm-up), every 4th and the last
    assert evals == [(i, r) for i in (0, 4, 8, 12) for r in (0, 1)]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records if r["kind"] in ("eval", "final"))
    m = scheme_metrics({"iterations": [r for r in records if r["kind"] != "endpoint"], "switches": {}})
    trace = m["accuracy_trace"]
    assert len(trace) == 4 and trace[0][0] == 0.0
    times = [t for t, _ in trace]
    assert all(b > a for a, b in zip(times, times[1:]))  # the clock is the measured iterations'
    measured = sorted((r["iteration"], r["iteration_time"]) for r in records if r["kind"] == "measured"
                      and r["rank"] == 0)
    assert math.isclose(trace[-1][0], sum(t for _, t in measured), rel_tol=0.5)
    # training learns: the digits MLP is far above chance (10 %) after 12 steps
    assert trace[-1][1] > 0.3 and math.isclose(trace[-1][1], m["accuracy"], abs_tol=1e-9)
