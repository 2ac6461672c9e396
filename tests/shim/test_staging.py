"""Host staging of device tensors (dlcp_torch.staging), on CPU: the logic a CUDA tensor takes,
with plain host copies forced (this machine has no GPU; the CUDA copies themselves are not run)."""

from __future__ import annotations

import pytest
import torch

from dlcp_torch.staging import HostCopies, Staging


def test_a_staged_collective_works_on_host_copies_and_its_result_lands_in_the_callers_tensors():
    staging = Staging(HostCopies(always=True))
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.arange(8, dtype=torch.bfloat16)[::2]  # not contiguous: written back through its view
    group = [a, b]
    seen = []

    def collective() -> None:
        seen.extend(group)
        for t in group:
            t.mul_(2)

    staging.run([group], staging.issued([group]), collective)
    assert all(s is not a and s is not b for s in seen)  # the collective saw host copies
    assert group[0] is a and group[1] is b  # the caller's tensors are back in its list
    torch.testing.assert_close(a, torch.arange(6, dtype=torch.float32).view(2, 3) * 2)
    torch.testing.assert_close(b, torch.arange(8, dtype=torch.bfloat16)[::2] * 2)


def test_host_buffers_are_reused_step_after_step():
    staging = Staging(HostCopies(always=True))
    for _ in range(5):
        group = [torch.ones(10), torch.ones(3, dtype=torch.float16)]
        staging.run([group], None, lambda: None)
    assert staging.allocated == 2


def test_a_failing_collective_restores_the_lists_and_returns_its_buffers():
    staging = Staging(HostCopies(always=True))
    t = torch.ones(4)
    group = [t]

    def boom() -> None:
        group[0].fill_(7)
        raise RuntimeError("peer lost")

    with pytest.raises(RuntimeError, match="peer lost"):
        staging.run([group], None, boom)
    assert group[0] is t
    torch.testing.assert_close(t, torch.ones(4))  # a failed collective writes nothing back
    staging.run([[torch.ones(4)]], None, lambda: None)
    assert staging.allocated == 1


def test_host_tensors_are_not_staged_unless_forced():
    staging = Staging(HostCopies())
    t = torch.ones(3)
    group = [t]
    staging.run([group], None, lambda: group[0].add_(1))
    assert staging.allocated == 0 and t.tolist() == [2.0, 2.0, 2.0]
