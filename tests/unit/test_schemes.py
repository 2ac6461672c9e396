"""The schemes a testbed run compares: gloo's beside DLCP's, patterns named per scheme, the
reference that speedups are against. Pure: nothing starts a switch or a process."""

from __future__ import annotations

import math

import pytest

from dlcp.hostagent.errors import DlcpUserError, UsageError
from dlcp.topologies.report import aggregate, summary
from dlcp.topologies.runner import RunOptions, agent_spec, reference_scheme, scheme_bound, scheme_policy
from dlcp.topologies.schemes import FP16_SCHEMES, GLOO_SCHEMES, fabric_of, mechanisms, split_label, torch_backend_of
from dlcp.topologies.topos import star

from dlcp.topologies.results import upgrade

from .test_report import _run, _training_run, as_testbed_results


def test_a_scheme_may_name_its_pattern_and_gloo_is_always_a_ring():
    assert split_label("dlcp", "ps") == ("dlcp", "ps")
    assert split_label("dlcp:ring", "ps") == ("dlcp", "ring")
    assert split_label("baseline:ps", "ring") == ("baseline", "ps")
    assert split_label("gloo", "ps") == ("gloo", "ring") and split_label("powersgd:ring", "ps") == ("powersgd", "ring")
    with pytest.raises(DlcpUserError, match="stock DDP has no parameter server"):
        split_label("gloo-fp16:ps", "ring")
    assert split_label("dlcp-backend", "ps") == ("dlcp-backend", "ring")
    with pytest.raises(DlcpUserError, match="stock DDP has no parameter server"):
        split_label("dlcp-backend:ps", "ring")
    with pytest.raises(DlcpUserError, match="unknown pattern 'tree'"):
        split_label("dlcp:tree", "ps")


@pytest.mark.parametrize("scheme", sorted(GLOO_SCHEMES))
def test_gloo_runs_on_the_baselines_fabric(scheme):
    opts = RunOptions(schemes=(scheme,))
    assert scheme_policy(scheme, opts) == scheme_policy("baseline", opts)
    assert not any(mechanisms(scheme).values())
    spec = agent_spec(opts, scheme_policy(scheme, opts), ["10.0.0.1", "10.0.0.2"], scheme=scheme)
    assert (spec["transport"], spec["backend"], spec["hook"]) == ("torch", "gloo", GLOO_SCHEMES[scheme])
    dlcp = agent_spec(opts, scheme_policy("dlcp", opts), ["10.0.0.1"], scheme="dlcp")
    assert (dlcp["transport"], dlcp["backend"]) == ("dlcp", None)


def test_the_dlcp_backend_runs_stock_ddp_on_dlcps_fabric_with_training_workloads_only():
    """``dlcp-backend``: gloo's stock-DDP script over ``init_process_group("dlcp")``, on the
    switches and policy of ``dlcp``; refused on a synthetic workload (outside a backward pass the
    backend's all-reduce carries no gradient tags), and its data's paths are not computed from
    DLCP's fixed ports (the backend picks its own)."""
    opts = RunOptions(schemes=("gloo", "dlcp-backend", "dlcp:ring"), pattern="ring", workers=2, workload="digits")
    opts.validate()
    assert fabric_of("dlcp-backend") == "dlcp" and mechanisms("dlcp-backend") == mechanisms("dlcp")
    assert scheme_policy("dlcp-backend", opts) == scheme_policy("dlcp", opts)
    spec = agent_spec(opts, scheme_policy("dlcp-backend", opts), ["10.0.0.1", "10.0.0.2"], scheme="dlcp-backend")
    assert (spec["transport"], spec["backend"], spec["hook"]) == ("torch", "dlcp", None)
    assert torch_backend_of("gloo-fp16") == "gloo" and torch_backend_of("dlcp") is None
    with pytest.raises(UsageError, match="dlcp-backend .* needs a training workload"):
        RunOptions(schemes=("gloo", "dlcp-backend"), pattern="ring", workload="resnet50").validate()


def test_gloo_over_tcp_with_ecn_sets_its_hosts_tcp_and_needs_its_congestion_control(monkeypatch):
    """``gloo-ecn`` and ``gloo-dctcp`` are stock DDP over gloo whose hosts ask for ECN (the
    latter with DCTCP): the same fabric and agents as ``gloo``, other sysctls while they run; a
    kernel without DCTCP refuses ``gloo-dctcp`` before anything starts, saying what to do."""
    from dlcp.hostagent.errors import UsageError
    from dlcp.topologies import runner
    from dlcp.topologies.schemes import GLOO_TCP

    assert GLOO_TCP["gloo-ecn"] == {"net.ipv4.tcp_ecn": "1"} and "gloo" not in GLOO_TCP
    assert GLOO_TCP["gloo-dctcp"]["net.ipv4.tcp_congestion_control"] == "dctcp"
    assert all(GLOO_SCHEMES[s] is None for s in GLOO_TCP)  # DDP's own all-reduce
    monkeypatch.setattr(runner, "tcp_congestion_controls", lambda: {"reno", "cubic"})
    monkeypatch.setattr(runner.bpf_dctcp, "registered", lambda: False)
    RunOptions(schemes=("gloo", "gloo-ecn", "dlcp:ring")).validate()
    # no DCTCP in the kernel, and none of what the BPF DCTCP needs to stand in
    monkeypatch.setattr(runner.bpf_dctcp, "why_unavailable", lambda: "the BPF DCTCP needs clang")
    with pytest.raises(UsageError, match=r"gloo-dctcp runs gloo over dctcp, which this kernel does not have.*"
                                         r"modprobe tcp_dctcp.*the BPF DCTCP needs clang to stand in"):
        RunOptions(schemes=("gloo", "gloo-dctcp")).validate()
    # ... the BPF DCTCP can stand in: the hosts take it by its name
    monkeypatch.setattr(runner.bpf_dctcp, "why_unavailable", lambda: None)
    opts = RunOptions(schemes=("gloo", "gloo-dctcp"))
    opts.validate()
    assert runner.gloo_tcp("gloo-dctcp")["net.ipv4.tcp_congestion_control"] == "dlcp_dctcp"
    assert runner.needs_bpf_dctcp(opts) and runner.scheme_congestion_controls(opts) == ["dlcp_dctcp"]
    # the kernel's own DCTCP where it has one
    monkeypatch.setattr(runner, "tcp_congestion_controls", lambda: {"reno", "cubic", "dctcp"})
    opts.validate()
    assert runner.gloo_tcp("gloo-dctcp")["net.ipv4.tcp_congestion_control"] == "dctcp"
    assert not runner.needs_bpf_dctcp(opts)


def test_dlcp_fp16_runs_dlcps_fabric_and_policy_with_half_the_bytes():
    """``dlcp-fp16`` is ``dlcp`` with float16 on the wire: the same switches and policy, agents
    told to send halves, and a line-rate bound of half the packets."""
    opts = RunOptions(schemes=("dlcp", "dlcp-fp16:ring"), pattern="ring", workers=2)
    opts.validate()
    assert scheme_policy("dlcp-fp16", opts) == scheme_policy("dlcp", opts)
    assert mechanisms("dlcp-fp16") == mechanisms("dlcp") and set(FP16_SCHEMES) >= {"dlcp-fp16", "baseline-fp16"}
    topo = star(2)
    ips = ["10.0.0.1", "10.0.0.2"]
    full = agent_spec(opts, scheme_policy("dlcp", opts), ips, scheme="dlcp")
    half = agent_spec(opts, scheme_policy("dlcp-fp16", opts), ips, scheme="dlcp-fp16")
    assert (full["wire_dtype"], half["wire_dtype"], half["transport"]) == ("float32", "float16", "dlcp")
    bound_full, bound_half = (scheme_bound(topo, opts, s, sp) for s, sp in (("dlcp", full), ("dlcp-fp16", half)))
    assert bound_full is not None and bound_half is not None
    assert bound_half["packets"] < 0.6 * bound_full["packets"]
    with pytest.raises(DlcpUserError, match="gloo-fp16-fp16"):
        RunOptions(schemes=("gloo-fp16-fp16",)).validate()


def test_the_line_rate_bound_is_dlcps_and_gloos_uncompressed_ring_only():
    opts = RunOptions(schemes=("gloo", "gloo-fp16"), pattern="ring", workers=2)
    topo = star(2)
    spec = agent_spec(opts, scheme_policy("gloo", opts), ["10.0.0.1", "10.0.0.2"], scheme="gloo")
    bound = scheme_bound(topo, opts, "gloo", spec)
    assert bound is not None and bound["seconds"] > 0
    assert scheme_bound(topo, opts, "gloo-fp16", spec) is None  # its bytes on the wire are half


@pytest.mark.parametrize("opts, words", [
    (RunOptions(schemes=("powersgd",)), "powersgd compresses a real model's gradients"),
    (RunOptions(schemes=("gloo:ps",)), "stock DDP has no parameter server"),
    (RunOptions(schemes=("dlcp", "dlcp")), "names a scheme twice"),
    (RunOptions(schemes=("dlcp", "gloo"), reference="baseline"), "--reference 'baseline' is not one of"),
    (RunOptions(schemes=("tcp",)), "unknown scheme(s) ['tcp']"),
])
def test_bad_schemes_are_refused_before_anything_starts(opts, words):
    with pytest.raises(UsageError) as exc:
        opts.validate()
    assert words in str(exc.value)


def test_every_known_combination_validates():
    RunOptions(schemes=("gloo", "gloo-fp16", "powersgd", "dlcp", "dlcp:ring"), workload="mnist1d").validate()
    RunOptions(schemes=("gloo", "gloo-fp16", "baseline", "dlcp:ring")).validate()


def test_the_reference_is_what_users_run_when_it_runs():
    assert reference_scheme(RunOptions(schemes=("baseline", "dlcp", "gloo"))) == "gloo"
    assert reference_scheme(RunOptions(schemes=("baseline", "dlcp"))) == "baseline"
    assert reference_scheme(RunOptions(schemes=("dlcp", "dlcp:ring"))) is None
    assert reference_scheme(RunOptions(schemes=("gloo", "dlcp"), reference="dlcp")) == "dlcp"


def test_speedups_and_the_accuracy_target_are_against_the_reference():
    runs = []
    for r in range(5):
        runs.append(_training_run("gloo", r, 1.0, [0.1, 0.5, 0.7, 0.8, 0.85, 0.90]))
        runs.append(_training_run("baseline", r, 2.0, [0.1, 0.5, 0.7, 0.8, 0.85, 0.95]))
        runs.append(_training_run("dlcp:ring", r, 0.5, [0.1, 0.5, 0.7, 0.8, 0.89, 0.897]))
    results = as_testbed_results(runs, reference="gloo")
    agg = aggregate(results)
    assert math.isclose(agg["dlcp:ring"]["speedup"].median, 2.0)
    assert math.isclose(agg["baseline"]["speedup"].median, 0.5)
    assert math.isclose(agg["dlcp:ring"]["tta_target"], 0.895 - 0.005)  # gloo's final (mean of workers) - 0.5
    text = summary(results)
    assert "speedup = gloo's iteration p50" in text and "dlcp:ring: faster than gloo" in text
    assert "baseline: slower than gloo" in text and "(gloo final - 0.5 points)" in text
    # results written before runs had a reference compared with baseline
    old = upgrade({"schemes": [_run("baseline", 0, 1.0), _run("dlcp", 0, 0.5)]})
    assert math.isclose(aggregate(old)["dlcp"]["speedup"].median, 2.0)


def test_a_results_page_table_is_generated_from_the_results(tmp_path, capsys):
    import json

    from dlcp import cli
    from dlcp.topologies.results_table import markdown

    runs = []
    for r in range(5):
        runs.append(_training_run("gloo", r, 1.0, [0.1, 0.5, 0.7, 0.8, 0.85, 0.90]))
        runs.append(_training_run("dlcp", r, 0.5, [0.1, 0.5, 0.7, 0.8, 0.89, 0.897]))
        runs[-1]["cross"] = {"udp": {"loss": 0.1}, "tcp": {"retrans_pkts": 40, "goodput_mbps": 2.0}}
        runs[-2]["gloo_ports_fixed"] = True
        runs[-2]["port_bytes"] = {"l1:9": 5_000_000}
        runs[-1]["paths"] = runs[-2]["paths"] = {"cross udp": "l1:9 sp2:2 l2:4", "gloo worker1>worker2": "l1:9 sp2:2"}
    made = {"command": "dlcp run --scheme gloo,dlcp", "commit": "abc1234", "started": "x"}
    results = as_testbed_results(runs, {"target_accuracy": None, "iterations": 10}, reference="gloo", provenance=made)
    text = markdown(results)
    row = next(line for line in text.splitlines() if line.startswith("| `dlcp`"))
    assert "| 5/5 | 250 [250, 250] | 500 [500, 500] | 2.00 [2.00, 2.00]x | - |" in row  # (no port service read)
    assert "UDP loss 10.0 %, TCP 40 resent, 2.00 Mbit/s" in row
    assert "`dlcp` is faster than `gloo` per iteration" in text and "commit abc1234" in text
    # per run, where the cross flows entered the fabric and what those links carried (runs with both only)
    assert "| `gloo` | 5 | 1000 | yes | l1:9 5 MB | - |" in text and text.count("MB | - |") == 5  # not dlcp's
    # from 3 runs: the range, and no verdict
    three = markdown(as_testbed_results([r for r in runs if r["repeat"] < 3], {"target_accuracy": None,
                                                                              "iterations": 10}, reference="gloo"))
    assert "2.00 (range 2.00..2.00)x" in three and "no verdict (an interval needs 5)" in three
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "| `gloo` | 5/5 | 500 [500, 500] | 1000 [1000, 1000] | 1 |" in capsys.readouterr().out
    # a slim copy (no per-iteration records) regenerates the same tables
    assert cli.main(["report", str(path), "--slim", str(tmp_path / "slim")]) == 0
    full = capsys.readouterr().out
    slim = json.loads((tmp_path / "slim" / f"{tmp_path.name}.json").read_text())
    assert all("iterations" not in s for s in slim["runs"])
    assert all(s["paths"]["cross udp"] for s in slim["runs"]) and slim["runs"][0]["gloo_ports_fixed"] is True
    assert slim["runs"][0]["port_bytes"] == {"l1:9": 5_000_000}
    assert cli.main(["report", str(tmp_path / "slim" / f"{tmp_path.name}.json")]) == 0
    assert capsys.readouterr().out.split("| scheme")[1] == full.split("| scheme")[1]
    assert cli.main(["report", str(tmp_path / "missing.json")]) == 2
    assert "not a run's results" in capsys.readouterr().err
    # paired with another scheme: gloo is then half as fast, and the target stays the run's
    assert "target accuracy 89.00 %" in full
    assert cli.main(["report", str(path), "--against", "dlcp"]) == 0
    text = capsys.readouterr().out
    assert "target accuracy 89.00 %" in text and "`gloo` is slower than `dlcp` per iteration: 0.50" in text
    assert cli.main(["report", str(path), "--against", "powersgd"]) == 2
    assert "--against: 'powersgd' is not one of the run's schemes" in capsys.readouterr().err


def test_every_scheme_of_a_repetition_sends_from_its_fixed_ports():
    # Per-flow ECMP hashes the 5-tuple: the schemes of one repetition share source ports, so
    # they meet the same collisions; repetitions draw others (as the simulator's seeds).
    from dlcp.hostagent.transport_config import Peer, TransportConfig, source_ports
    from dlcp.topologies.runner import CROSS_TCP_PORT, FLOW_PORT_DRAWS, flow_port_base

    opts = RunOptions(workers=7)
    ips = [f"10.0.0.{i}" for i in range(1, 9)]
    bases = [flow_port_base(r) for r in range(FLOW_PORT_DRAWS)]
    assert len(set(bases)) == FLOW_PORT_DRAWS and flow_port_base(FLOW_PORT_DRAWS) == bases[0]
    # DLCP's eight ranks and the cross senders stay below the ephemeral range and apart
    assert all(source_ports(b, 7)[1] < b + CROSS_TCP_PORT // 2 and b + CROSS_TCP_PORT < 32768 for b in bases)
    assert len({b + k for b in bases for k in range(1024)}) == 1024 * FLOW_PORT_DRAWS
    for scheme in ("baseline", "bounded", "gloo"):
        spec = agent_spec(opts, scheme_policy(scheme, opts), ips, scheme=scheme, repeat=3)
        assert spec["source_port_base"] == flow_port_base(3)
    assert "source_port_base" not in agent_spec(opts, scheme_policy("dlcp", opts), ips)
    peers = tuple(Peer(r, ip, spec["data_port"], spec["control_port"]) for r, ip in enumerate(ips))
    assert TransportConfig(rank=7, peers=peers, source_port_base=spec["source_port_base"]).source_port_base


def test_schemes_of_one_repetition_train_from_its_seed_and_repetitions_differ():
    """Paired by repetition, two schemes start from the same weights and draw the same batches;
    another repetition starts elsewhere, so an interval over repetitions covers trajectories."""
    import torch

    from dlcp.topologies.training import Training

    opts = RunOptions(workload="mnist1d", iterations=2)
    ips = ["10.0.0.1", "10.0.0.2"]

    def start(scheme: str, repeat: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        spec = agent_spec(opts, scheme_policy(scheme, opts), ips, scheme=scheme, repeat=repeat)
        assert spec["seed"] == repeat
        train = Training.setup(spec, rank)
        weights = torch.cat([p.detach().flatten() for p in train.model.parameters()])
        return weights, torch.cat([x for _, x, _ in train.batches()])

    w0, b0 = start("gloo", 0)
    w0d, b0d = start("dlcp", 0)
    assert torch.equal(w0, w0d) and torch.equal(b0, b0d)
    w1, b1 = start("dlcp", 1)
    assert not torch.equal(w0, w1) and not torch.equal(b0, b1)
    assert not torch.equal(start("dlcp", 1, rank=1)[1], b1)  # every worker its own batches
    # a spec without a seed (written before runs had one) trains from seed 0
    spec = agent_spec(opts, scheme_policy("gloo", opts), ips, scheme="gloo")
    assert "seed" not in spec
    assert torch.equal(torch.cat([p.detach().flatten() for p in Training.setup(spec, 0).model.parameters()]), w0)


def test_a_run_records_the_path_of_every_flow_hashed_flow():
    from dlcp.topologies.runner import flow_paths
    from dlcp.topologies.topos import leafspine

    opts = RunOptions(topology="leafspine", workers=4, pattern="ps")
    topo = leafspine(4)
    ips = [h.ip for h in topo.role("worker")] + [topo.role("server")[0].ip]
    x = [h.ip for h in topo.role("cross")]
    cross = [(x[0], x[1]), (x[0], x[1])]

    def paths(scheme: str, repeat: int) -> dict[str, str]:
        policy = scheme_policy(scheme, opts)
        network = topo.network("/tmp", opts.capacity_pps, opts.buffer, policy.to_dict(), None)
        spec = agent_spec(opts, policy, ips, scheme=scheme, repeat=repeat)
        return flow_paths(network, spec, policy, scheme in GLOO_SCHEMES, cross, repeat)

    base = paths("baseline", 0)
    # a parameter server: each worker to the server and back, at each of the 8 priorities, and the cross traffic
    assert len(base) == 2 * 4 * 8 + 2 and "worker0>worker1 q0" not in base
    assert base["worker0>server q0"].split()[0].startswith("l1:") and base["worker0>server q0"].endswith("l2:3")
    spines = {v.split()[1].split(":")[0] for k, v in base.items() if k.startswith("worker0>")}
    assert spines == {"sp1", "sp2"}  # eight flows of one pair spread over both spines
    assert paths("bounded", 0) == base and paths("baseline", 1) != base  # one draw per repetition
    assert set(paths("dlcp", 0)) == {"cross udp", "cross tcp"}  # sprayed
    # gloo: one TCP connection per pair of workers (both directions), from its fixed ports
    gloo = paths("gloo", 0)
    assert set(gloo) == {"cross udp", "cross tcp"} | {f"gloo worker{a}>worker{b}" for a in range(4) for b in range(4)
                                                       if a != b}
    assert paths("gloo-fp16", 0) == gloo and paths("gloo", 1) != gloo
