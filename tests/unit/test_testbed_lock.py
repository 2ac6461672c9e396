"""One testbed run at a time: a second run is refused at once, naming the one that holds it."""

import subprocess
import sys

import pytest

from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.registry import hold_testbed

HOLD = """
import sys, time
from pathlib import Path
from dlcp.topologies.registry import hold_testbed
with hold_testbed(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_second_run_is_refused_while_the_first_holds_the_testbed_and_not_after(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DlcpUserError, match=rf"another dlcp run \(pid {holder.pid}\) is using the testbed"):
            with hold_testbed(tmp_path):
                pytest.fail("took a held testbed")
    finally:
        holder.kill()  # a holder that dies (crash, SIGKILL) frees the testbed with it
        holder.wait()
    with hold_testbed(tmp_path):
        assert (tmp_path / "testbed.lock").read_text().strip() == str(__import__("os").getpid())
    with hold_testbed(tmp_path):  # released on leaving, and taken again
        pass
