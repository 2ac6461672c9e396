"""A benchmark's tables kept as a file print on a results page as they were measured."""

from __future__ import annotations

import json

import pytest

from dlcp.cli import main
from dlcp.hostagent import tables
from dlcp.hostagent.tables import Column, Table


def _table() -> Table:
    t = Table("2. collectives", [Column(""), Column("sync ms", "{:.1f}"), Column("x gloo", "{:.2f}"),
                                 Column("overruns")], notes=["x gloo: the median of per-round ratios."])
    t.add("gloo all_reduce", 152.04, 1.0, 0)
    t.add("DLCP ring, lossless", 160.55, 1.0559, None)
    return t


def test_a_table_keeps_numbers_and_formats_them_once():
    t = _table()
    assert t.cells()[1] == ["DLCP ring, lossless", "160.6", "1.06", "-"]
    md = t.markdown()
    assert "| DLCP ring, lossless | 160.6 | 1.06 | - |" in md and md.startswith("**2. collectives**")
    text = t.text().splitlines()
    assert text[0] == "2. collectives" and text[-1] == "x gloo: the median of per-round ratios."
    assert len({len(line) for line in text[1:-1]}) == 1  # columns padded to one width
    with pytest.raises(ValueError, match="a row of 2 cells for 4 columns"):
        t.add("short", 1.0)


def test_dlcp_report_prints_a_benchmarks_tables_with_what_made_them(tmp_path, capsys):
    path = tmp_path / "bench.json"
    made = {"command": "python bench/transport.py --part collective", "commit": "abc1234", "started": "then"}
    tables.write(path, [_table()], made, {"machine": "2 CPUs"})
    back = json.loads(path.read_text())
    assert tables.is_tables(back) and back["tables"][0]["rows"][0] == ["gloo all_reduce", 152.04, 1.0, 0]
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "`python bench/transport.py --part collective` at commit abc1234" in out
    assert "Machine: 2 CPUs." in out and _table().markdown() in out
