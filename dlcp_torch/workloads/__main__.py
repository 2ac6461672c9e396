"""``python -m dlcp_torch.workloads NAME [options]``: train a workload by name.

``dlcp converge`` starts its runs this way, so each run imports the workload's module under its
own name (never as ``__main__``) and needs nothing from a source checkout.
"""

from __future__ import annotations

import sys

from dlcp_torch.workloads import WORKLOAD_MODULES, get_workload
from dlcp_torch.workloads.script import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in WORKLOAD_MODULES:
        sys.exit(f"usage: python -m dlcp_torch.workloads {{{','.join(sorted(WORKLOAD_MODULES))}}} [options]")
    name = sys.argv[1]
    sys.argv[0] = f"python -m dlcp_torch.workloads {name}"
    workload = get_workload(name)
    main(workload, sys.modules[WORKLOAD_MODULES[name]].__doc__, sys.argv[2:])
