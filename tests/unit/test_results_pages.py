"""The tables on the results pages are what `dlcp report` prints from the files kept beside
them (docs/results/data/), today: a page cannot drift from its data, and a change to the report
that alters a published figure fails here."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from dlcp.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"

#: Each page and the `dlcp report` arguments (data files, options) whose every table row it shows.
PAGES: dict[str, list[list[str]]] = {
    "benchmarks.md": [["20261126-bench-packetizer.json"], ["20261127-1120-bench-transport.json"],
                      ["20261127-1615-bench-goodput-100g.json"], ["20261126-bench-hostile.json"],
                      ["20261128-bench-forgeries.json"], ["20261130-bench-protection-mtu1500-9054deb.json"],
                      ["20261130-bench-protection-mtu9000-9054deb.json"], ["20261130-bench-collective-5ddfac1.json"]],
    "backend.md": [["20261202-bench-backend-paired-cut-through-e99ef96.json"],
                   ["20261202-bench-backend-paired-untagged-e99ef96.json"],
                   ["20261202-bench-backend-12m-a5fe7ff.json"],
                   ["20261202-bench-backend-paired-b013d2e.json"], ["20261202-bench-backend-paired-9b6e8b6.json"],
                   ["20261202-bench-cpu-profile-4p-61865a2.json"],
                   ["20261202-bench-backend-idle-015a79f.json"], ["20261202-bench-backend-idle-oldcore-015a79f.json"],
                   ["20261202-bench-backend-paired-4db1da2.json"], ["20261202-bench-backend-4db1da2.json"],
                   ["20261202-bench-backend-bf16-39197dd.json"], ["20261202-bench-backend-paired-700df9a.json"],
                   ["20261202-bench-backend-700df9a.json"],
                   ["20261201-bench-backend-paired-6727af1.json"], ["20261201-bench-backend-paired-daec086.json"],
                   ["20261201-bench-backend-paired-e6b2b63.json"], ["20261201-bench-backend-6727af1.json"],
                   ["20261201-bench-backend-daec086.json"], ["20261201-bench-cpu-profile-4p-daec086.json"],
                   ["20261201-bench-cpu-profile-4p-6727af1.json"], ["20261201-bench-cpu-profile-4p-58732cf.json"],
                   ["20261201-bench-cpu-profile-2p-58732cf.json"],
                   ["20261201-bench-backend-85dfedd.json"], ["20261201-bench-backend-small-85dfedd.json"],
                   ["20261130-bench-backend-paired-84502ba.json"],
                   ["20261130-bench-backend-52db552.json"], ["20261130-bench-backend-small-52db552.json"],
                   ["20261130-bench-backend-paired-6a539fc.json"], ["20261130-bench-backend-82db73f.json"],
                   ["20261130-bench-backend-4p-9b999c1.json"], ["20261130-bench-backend-ring-ed59591.json"],
                   ["20261130-bench-backend-2a56fad.json"], ["20261129-bench-backend.json"],
                   ["20261130-bench-backend-paired-small-7ff9551.json"],
                   ["20261130-bench-backend-small-39b0ba7.json"], ["20261130-bench-backend-small-3eb0b70.json"],
                   ["20261129-bench-backend-small.json"]],
    "sim-speed.md": [["20261126-bench-sim.json"]],
    "digits-demo.md": [["20261126-demo.json"]],
    "convergence-loss-bound.md": [["20261126-converge-mnist1d.csv"]],
    "sim-background-load.md": [["20261126-sim32-load50.json"], ["20261126-sim-load32.csv"],
                               ["20261126-sim-load144.csv"], ["20261126-sim144-load50.json", "--against", "tcp-dctcp"]],
    "ecn-rule.md": [["20261126-sim-ecn32.csv"], ["20261129-testbed-ecn.csv"], ["20261126-testbed-ecn.csv"],
                    ["20261126-213944-leafspine.json"], ["20261126-214417-leafspine.json"]],
    "testbed-headline.md": [["20261129-073152-leafspine.json"], ["20261129-092344-leafspine.json"],
                            ["20261129-090911-leafspine.json"],
                            ["20261126-headline-cross-rate.csv"], ["20261126-211547-leafspine.json"]],
    "sim-144-hosts.md": [["20261126-sim-hosts-ps.csv"], ["20261126-sim-hosts-ring.csv"],
                         ["20261126-sim144-ps.json", "--against", "tcp-dctcp"],
                         ["20261126-sim144-ring.json", "--against", "tcp-dctcp"], ["20261126-sim64-mechanisms.json"]],
    "sim-validation.md": [["20261130-185428-leafspine.json"], ["20261130-063157-leafspine.json"],
                          ["20261130-052226-leafspine.json"],
                          ["20261130-033654-leafspine.json"], ["20261130-simval50-ring.json"],
                          ["20261129-155049-leafspine.json"], ["20261129-simval50-ring.json"],
                          ["20261129-071723-leafspine.json"], ["20261128-183805-leafspine.json"],
                          ["20261128-simval-ps.json"],
                          ["20261128-simval-ring.json"]],
    "testbed-one-capacity.md": [["20261128-034854-leafspine.json"]],
    "testbed-vs-gloo.md": [["20261130-180051-leafspine.json"], ["20261130-053558-leafspine.json"],
                           ["20261130-015110-leafspine.json"], ["20261129-133954-leafspine.json"],
                           ["20261129-112318-leafspine.json", "20261129-163204-leafspine.json", "--merge"],
                           ["20261129-022056-leafspine.json"],
                           ["20261129-062255-leafspine.json"],
                           ["20261129-062255-leafspine.json", "--against", "gloo-fp16"],
                           ["20261128-225814-leafspine.json"],
                           ["20261128-194717-leafspine.json"],
                           ["20261126-131439-leafspine.json"], ["20261126-132312-leafspine.json"],
                           ["20261129-193156-leafspine.json"],
                           ["20261129-211527-leafspine.json"],
                           ["20261129-211527-leafspine.json", "--against", "gloo-dctcp"],
                           ["20261129-234218-leafspine.json", "20261130-004611-leafspine.json", "--merge"]],
}


def _rows(args: list[str]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # (every data file named, the first and any other: --merge takes several)
        assert main(["report", *(str(RESULTS / "data" / a) if (RESULTS / "data" / a).is_file() else a
                                 for a in args)]) == 0
    return [line for line in out.getvalue().splitlines() if line.startswith(("| ", "|---"))]


@pytest.mark.parametrize("page, args", [(p, a) for p, runs in PAGES.items() for a in runs],
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_a_pages_tables_are_what_dlcp_report_prints_from_its_data(page, args):
    text = (RESULTS / page).read_text()
    rows = _rows(args)
    assert rows, f"dlcp report {' '.join(args)} printed no table"
    missing = [r for r in rows if r not in text]
    assert not missing, f"{page} does not show {len(missing)} row(s) of dlcp report {' '.join(args)}: {missing[:3]}"


def test_every_kept_data_file_is_reported_on_some_page():
    listed = {a[0] for runs in PAGES.values() for a in runs}
    cited = {p.name for p in (RESULTS / "data").iterdir()} - listed
    # the rest are cited in a page's text for figures it quotes
    for name in cited:
        assert any(name in p.read_text() for p in RESULTS.glob("*.md")), f"data/{name} is on no page"
