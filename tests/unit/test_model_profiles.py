"""Model profiles add up to the published parameter counts."""

import pytest

from dlcp.hostagent.model_profiles import PROFILES, layer_sizes


@pytest.mark.parametrize("name,total,tensors", [("resnet50", 25_557_032, 161), ("vgg16", 138_357_544, 32),
                                                ("transformer", 108_891_648, 197)])
def test_totals(name, total, tensors):
    sizes = PROFILES[name]()
    assert sum(n for _, n in sizes) == total and len(sizes) == tensors


def test_scaling_keeps_every_tensor():
    small = layer_sizes("resnet50", 0.001)
    assert len(small) == 161 and min(small) >= 1 and sum(small) < 30_000
    with pytest.raises(ValueError, match="unknown model profile"):
        layer_sizes("resnet51")
