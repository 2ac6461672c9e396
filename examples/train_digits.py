"""Train an MLP on scikit-learn's bundled digits data, data-parallel through DLCP.

Runs anywhere: nothing is downloaded (the digits ship with scikit-learn).

    # under torchrun (one process per worker; the PS runs beside worker 0):
    torchrun --nproc-per-node 4 examples/train_digits.py --pattern ps
    # or let the script start the workers itself on this machine:
    python examples/train_digits.py --workers 4 --pattern ps
    # the demo: lossless vs bounded loss (vs error feedback), side by side
    python examples/train_digits.py --workers 4 --compare

The model and data are in dlcp_torch/workloads/digits.py; the training loop, with its two DLCP
lines marked ``# DLCP``, is in dlcp_torch/workloads/loop.py.
"""

from dlcp_torch.workloads.digits import WORKLOAD
from dlcp_torch.workloads.script import main

if __name__ == "__main__":
    main(WORKLOAD, __doc__)
