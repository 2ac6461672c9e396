"""Per-layer parameter counts of real models, for synthetic gradient workloads.

Computed from the architectures (not downloaded): ResNet-50 and VGG-16 as in torchvision
(ImageNet, 1000 classes), and a BERT-base-sized Transformer encoder. Layers are in forward
order (index 0 nearest the input), one entry per parameter tensor, so priorities and
message sizes are those a real training job would produce. Totals are checked in tests
against the published parameter counts.
"""

from __future__ import annotations

from collections.abc import Callable


def resnet50() -> list[tuple[str, int]]:
    """ResNet-50: 25,557,032 parameters in 161 tensors."""
    out: list[tuple[str, int]] = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    in_ch = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            out += [(f"{p}.conv1.weight", width * in_ch), (f"{p}.bn1.weight", width), (f"{p}.bn1.bias", width),
                    (f"{p}.conv2.weight", width * width * 9), (f"{p}.bn2.weight", width), (f"{p}.bn2.bias", width),
                    (f"{p}.conv3.weight", width * 4 * width), (f"{p}.bn3.weight", width * 4),
                    (f"{p}.bn3.bias", width * 4)]
            if b == 0:
                out += [(f"{p}.downsample.0.weight", width * 4 * in_ch), (f"{p}.downsample.1.weight", width * 4),
                        (f"{p}.downsample.1.bias", width * 4)]
            in_ch = width * 4
    out += [("fc.weight", 1000 * 2048), ("fc.bias", 1000)]
    return out


def vgg16() -> list[tuple[str, int]]:
    """VGG-16: 138,357,544 parameters in 32 tensors."""
    cfg = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    out, in_ch = [], 3
    for i, ch in enumerate(cfg):
        out += [(f"features.{i}.weight", ch * in_ch * 9), (f"features.{i}.bias", ch)]
        in_ch = ch
    for i, (n_in, n_out) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]):
        out += [(f"classifier.{i}.weight", n_in * n_out), (f"classifier.{i}.bias", n_out)]
    return out


def transformer(layers: int = 12, d: int = 768, ff: int = 3072, vocab: int = 30522,
                positions: int = 512) -> list[tuple[str, int]]:
    """A BERT-base-sized encoder: 108,891,648 parameters (BERT-base without its pooler), 197 tensors."""
    out = [("embeddings.word", vocab * d), ("embeddings.position", positions * d), ("embeddings.type", 2 * d),
           ("embeddings.ln.weight", d), ("embeddings.ln.bias", d)]
    for i in range(layers):
        p = f"layer{i}"
        for name in ("q", "k", "v", "o"):
            out += [(f"{p}.attn.{name}.weight", d * d), (f"{p}.attn.{name}.bias", d)]
        out += [(f"{p}.attn.ln.weight", d), (f"{p}.attn.ln.bias", d),
                (f"{p}.ff1.weight", d * ff), (f"{p}.ff1.bias", ff), (f"{p}.ff2.weight", ff * d), (f"{p}.ff2.bias", d),
                (f"{p}.ln.weight", d), (f"{p}.ln.bias", d)]
    return out


PROFILES: dict[str, Callable[[], list[tuple[str, int]]]] = {
    "resnet50": resnet50,
    "vgg16": vgg16,
    "transformer": transformer,
}


def layer_sizes(name: str, scale: float = 1.0, min_elems: int = 1) -> list[int]:
    """Element counts per tensor of model ``name``, multiplied by ``scale`` (at least ``min_elems``).

    Scaling keeps the shape of the profile (many small tensors, a few huge ones) while letting
    a BMv2 testbed at tens of kpps carry an iteration in reasonable time.
    """
    if name not in PROFILES:
        raise ValueError(f"unknown model profile {name!r}; one of {sorted(PROFILES)}")
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return [max(min_elems, round(n * scale)) for _, n in PROFILES[name]()]
