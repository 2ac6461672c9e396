"""The hosts' TCP congestion control: a host namespace may take only what the kernel lists as
allowed, so the runner adds the one asked for (:func:`dlcp.topologies.netns.with_allowed`)."""

from __future__ import annotations

from dlcp.topologies.netns import with_allowed


def test_the_asked_congestion_control_is_added_to_the_allowed_list_once():
    assert with_allowed("reno bbr", ("cubic",)) == "reno bbr cubic"
    assert with_allowed("reno bbr cubic\n", ("cubic",)) is None  # already allowed: nothing to change or put back
    assert with_allowed("", ("cubic",)) == "cubic"
    assert with_allowed("reno cubicx", ("cubic",)) == "reno cubicx cubic"  # names, not substrings
    assert with_allowed("reno bbr", ("cubic", "dctcp", "cubic", "bbr")) == "reno bbr cubic dctcp"
