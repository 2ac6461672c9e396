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


TRY = """
import sys
from pathlib import Path
from dlcp.hostagent.errors import DlcpUserError
from dlcp.topologies.registry import hold_testbed
try:
    with hold_testbed(Path(sys.argv[1])):
        print("took it")
except DlcpUserError as exc:
    print(exc)
"""


def test_a_sweep_holds_the_testbed_between_its_runs(tmp_path):
    """A sweep (or a calibration) holds the testbed across its runs, each of which takes it again
    in the same process; another process is refused between two of them, and takes it after."""

    def other() -> str:
        return subprocess.run([sys.executable, "-c", TRY, str(tmp_path)], capture_output=True, text=True,
                              check=True).stdout.strip()

    with hold_testbed(tmp_path):  # the sweep
        with hold_testbed(tmp_path):  # its first run
            pass
        assert other().startswith(f"another dlcp run (pid {__import__('os').getpid()})")  # between two runs
        with hold_testbed(tmp_path):  # its second run
            pass
    assert other() == "took it"


def test_a_sweep_without_root_fails_as_a_run_does_before_taking_anything(tmp_path, monkeypatch):
    """Not root: the sweep and the calibration say so, as `dlcp run` does, before they make a
    directory or take the testbed (the lock file is not even opened)."""
    from dlcp.topologies import registry, sweep
    from dlcp.topologies.runner import RunOptions

    monkeypatch.setattr("os.geteuid", lambda: 1000)  # (this suite runs as root where CI does)
    monkeypatch.setattr(registry, "REGISTRY", tmp_path / "registry")
    base = RunOptions(out=str(tmp_path / "runs"))
    with pytest.raises(DlcpUserError, match="needs root"):
        sweep.sweep(base, "buffer", ["32", "64"])
    with pytest.raises(DlcpUserError, match="needs root"):
        sweep.calibrate(base)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "registry").exists()
