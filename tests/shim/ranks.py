"""Where the shim's tests start their ranks: a forkserver that imported torch once.

Why: a spawned rank imports torch and DLCP afresh, 1-3 s of CPU for each of 2-4 ranks at once
on a 2-core machine, and these tests start ranks about fifty times (the suite's largest cost
after the builds). Forked from a server that only imported them, a rank starts in milliseconds.
The server runs no torch code before it forks (importing starts no thread), the safe way to
fork a torch process, and each rank still gets its target and arguments pickled as a spawned
one does. One difference: a rank inherits the server's environment, not the test's at the
time, so every rank sets what it needs itself (``MASTER_PORT``, ``DLCP_*``) from its arguments.
"""

from __future__ import annotations

import multiprocessing.context

import torch.multiprocessing as mp

#: Imported once by the server, shared by every rank forked from it.
PRELOAD = ["torch", "torch.distributed", "numpy", "dlcp_torch", "dlcp_torch.backend", "tests.shim.test_backend"]


def rank_context() -> multiprocessing.context.ForkServerContext:
    """The context to start ranks from (``ctx.Process``, ``ctx.Queue``, ``ctx.Event``)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
