"""Train a small 1-D CNN on MNIST-1D, data-parallel through DLCP.

MNIST-1D is generated on this machine (nothing is downloaded) and cached under ``~/.cache/dlcp``;
why this workload, and its model, are described in dlcp_torch/workloads/mnist1d.py. Needs the
``mnist1d`` extra: ``pip install -e '.[mnist1d]'`` in the repository.

    python examples/train_mnist1d.py --workers 4 --pattern ps
    python examples/train_mnist1d.py --workers 4 --loss 0.1 --bound 0.1 --eval-every 50
    python examples/train_mnist1d.py --workers 4 --compare --loss 0.2 --bound 0.2
    torchrun --nproc-per-node 4 examples/train_mnist1d.py --pattern ring
"""

from dlcp_torch.workloads.mnist1d import WORKLOAD
from dlcp_torch.workloads.script import main

if __name__ == "__main__":
    main(WORKLOAD, __doc__)
