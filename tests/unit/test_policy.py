"""Policy: validation, YAML/JSON round trips, and the pure tagging and completion rules."""

import numpy as np
import pytest

from dlcp.hostagent import policy as P
from dlcp.hostagent.policy import Policy, PolicyError


def test_defaults_are_valid_and_documented():
    pol = Policy()
    assert pol.top_priority == 7
    assert len(pol.drop_thresholds) == pol.num_drop_classes - 1
    assert pol.shares() == (0.25, 0.25, 0.25, 0.25)


@pytest.mark.parametrize("kwargs,field", [
    ({"num_priorities": 9}, "num_priorities"),
    ({"num_priorities": 0}, "num_priorities"),
    ({"band_strategy": "nope"}, "band_strategy"),
    ({"num_drop_classes": 3}, "drop_thresholds"),  # thresholds no longer match the class count
    ({"drop_thresholds": (10, 20, 5)}, "drop_thresholds"),  # increasing
    ({"drop_thresholds": (10, 0, 0)}, "drop_thresholds"),
    ({"ecn_threshold": 1 << 20}, "ecn_threshold"),
    ({"ecn_backlog": "queue"}, "ecn_backlog"),
    ({"loss_bound_push": 0.7}, "loss_bound_push"),
    ({"loss_bound_pull": -0.1}, "loss_bound_pull"),
    ({"magnitude": "l1"}, "magnitude"),
    ({"dscp": (0, 8, 64, 0, 0, 0, 0, 0)}, "dscp"),
    ({"priority_map": (0, 1)}, "priority_map"),
    ({"lb_mode": "hash"}, "lb_mode"),
    ({"drop_class_shares": (0.5, 0.5)}, "drop_class_shares"),
    ({"drop_class_shares": (0.5, 0.3, 0.1, 0.3)}, "drop_class_shares"),
    ({"num_priorities": "8"}, "num_priorities"),
])
def test_invalid_values_name_the_field_and_value(kwargs, field):
    with pytest.raises(PolicyError) as exc:
        Policy(**kwargs)
    assert field in str(exc.value)


def test_unknown_keys_are_errors():
    with pytest.raises(PolicyError, match="unknown policy field.*drop_treshold"):
        Policy.from_dict({"drop_treshold": [1, 2, 3]})


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_round_trip(tmp_path, suffix):
    pol = Policy(num_priorities=4, num_drop_classes=3, drop_thresholds=(40, 20), loss_bound_push=0.1,
                 drop_class_shares=(0.5, 0.25, 0.25), band_strategy="equal_bytes", lb_mode="random")
    path = tmp_path / f"policy{suffix}"
    P.save_policy(pol, path)
    assert P.load_policy(path) == pol


def test_load_reports_file_and_field(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("policy:\n  loss_bound_push: 2\n")
    with pytest.raises(PolicyError, match=r"p\.yaml.*loss_bound_push=2"):
        P.load_policy(path)
    path.write_text("[1, 2")
    with pytest.raises(PolicyError, match="cannot read policy"):
        P.load_policy(path)


def test_priorities_equal_layers_first_layers_highest():
    pol = Policy(num_priorities=4)
    got = P.layer_priorities([1] * 8, pol)
    assert got.tolist() == [3, 3, 2, 2, 1, 1, 0, 0]
    # fewer layers than priorities: each layer its own band, from the top
    assert P.layer_priorities([5, 5], pol).tolist() == [3, 1]


def test_priorities_equal_bytes():
    pol = Policy(num_priorities=2, band_strategy="equal_bytes")
    # 100 of 200 bytes are in the first layer: the second half starts at layer 1
    assert P.layer_priorities([100, 50, 50], pol).tolist() == [1, 0, 0]
    # a huge last layer does not push the small early ones out of the top band
    assert P.layer_priorities([1, 1, 1, 1000], pol).tolist() == [1, 1, 1, 1]


def test_band_strategies_are_pluggable():
    P.register_band_strategy("all_last", lambda sizes, bands: np.full(len(sizes), bands - 1))
    try:
        assert P.layer_priorities([1, 2, 3], Policy(band_strategy="all_last")).tolist() == [0, 0, 0]
    finally:
        del P.BAND_STRATEGIES["all_last"]
    P.register_band_strategy("broken", lambda sizes, bands: np.full(len(sizes), bands))
    try:
        with pytest.raises(ValueError, match="outside"):
            P.layer_priorities([1], Policy(band_strategy="broken"))
    finally:
        del P.BAND_STRATEGIES["broken"]


def test_packet_magnitudes_by_hand():
    data = np.array([3, 4, 0, 1, -2, 2, 5], dtype=np.float32)  # packets of 2: [3,4] [0,1] [-2,2] [5]
    np.testing.assert_allclose(P.packet_magnitudes(data, 2, "l2"), [5, 1, np.sqrt(8), 5])
    np.testing.assert_allclose(P.packet_magnitudes(data, 2, "maxabs"), [4, 1, 2, 5])
    half = np.full(4, 300, dtype=np.float16)  # 300^2 overflows float16; the norm must not
    np.testing.assert_allclose(P.packet_magnitudes(half, 4, "l2"), [600])


def test_drop_classes_by_hand():
    pol = Policy(num_drop_classes=2, drop_thresholds=(10,))
    assert P.drop_classes(np.array([4.0, 1.0, 3.0, 2.0]), pol).tolist() == [0, 1, 0, 1]
    pol4 = Policy()  # 4 equal classes, biggest in class 0
    mags = np.array([0.1, 8, 0.5, 7, 3, 0.2, 6, 2])
    assert P.drop_classes(mags, pol4).tolist() == [3, 0, 2, 0, 1, 3, 1, 2]


def test_drop_class_shares_are_exact():
    pol = Policy(drop_class_shares=(0.7, 0.1, 0.1, 0.1))
    classes = P.drop_classes(np.random.default_rng(1).random(1000), pol)
    assert np.bincount(classes).tolist() == [700, 100, 100, 100]
    assert P.drop_classes(np.zeros(0), pol).size == 0
    assert P.drop_classes(np.ones(3), Policy(num_drop_classes=1, drop_thresholds=())).tolist() == [0, 0, 0]


def test_payload_drop_classes_read_magnitudes_only_with_several_classes():
    data = np.random.default_rng(2).standard_normal(10_001).astype(np.float32)
    pol = Policy()
    np.testing.assert_array_equal(P.payload_drop_classes(data, 100, pol),
                                  P.drop_classes(P.packet_magnitudes(data, 100), pol))
    one = Policy(num_drop_classes=1, drop_thresholds=())
    assert P.payload_drop_classes(data, 100, one).tolist() == [0] * 101  # the tail packet too
    assert P.payload_drop_classes(data[:0], 100, one).size == 0
    with pytest.raises(ValueError, match="elems_per_packet"):
        P.payload_drop_classes(data, 0, one)


def test_a_large_messages_classes_come_from_a_sample_of_its_packets():
    """From SAMPLED_CLASSES_PACKETS packets on, a sample of about CLASS_SAMPLE packets sets the
    boundaries: the shares hold to the sample's precision (a periodic pattern too), a packet's
    class depends only on its own magnitude and the sample's, and below the threshold the rule
    is exact."""
    rng = np.random.default_rng(3)
    pol = Policy(drop_class_shares=(0.4, 0.3, 0.2, 0.1))
    n = 70_000  # a 100 MB message at MTU 1500
    assert P.class_sample_stride(n) == n // P.CLASS_SAMPLE and P.class_sample_stride(P.SAMPLED_CLASSES_PACKETS - 1) == 1
    mags = rng.lognormal(0, 2, n).astype(np.float32)
    classes = P.drop_classes(mags, pol)
    shares = np.bincount(classes, minlength=4) / n
    np.testing.assert_allclose(shares, pol.shares(), atol=0.05)
    assert np.all(np.diff([mags[classes == c].min() for c in range(4)]) < 0)  # larger magnitudes, lower class
    sample = P.class_sample(n)
    stride = P.class_sample_stride(n)
    assert sample.size == n // stride and np.array_equal(sample // stride, np.arange(sample.size))  # one per run
    assert len(set((sample % stride).tolist())) > stride // 2  # at offsets that vary
    other = mags.copy()
    keep = np.zeros(n, bool)
    keep[sample] = True
    other[~keep] = rng.permutation(other[~keep])  # the sample untouched, the rest moved about
    moved = P.drop_classes(other, pol)
    bounds = P.class_boundaries(mags[sample], pol)
    np.testing.assert_array_equal(moved, P.classes_from_boundaries(other, bounds, pol))
    np.testing.assert_array_equal(moved[keep], classes[keep])
    # ties go together (all-zero gradients are one class), NaN ranks last
    tied = np.zeros(n, np.float32)
    assert set(P.drop_classes(tied, pol).tolist()) == {0}
    tied[::20] = np.nan  # 5 %, every 20th: within the smallest 10 % (a fixed stride of 68 took 20 %)
    got = P.drop_classes(tied, pol)
    assert set(got[::20].tolist()) == {3} and set(np.delete(got, np.s_[::20]).tolist()) == {0}
    exact = P.SAMPLED_CLASSES_PACKETS - 1
    assert np.bincount(P.drop_classes(mags[:exact], Policy()), minlength=4).tolist() == [1024, 1024, 1023, 1024]


def _classes_by_sorting(mags: np.ndarray, pol: Policy) -> np.ndarray:
    """The definition: rank packets by magnitude, largest first, ties in packet order."""
    n = mags.size
    order = np.argsort(-mags, kind="stable")
    bounds = np.round(np.cumsum(pol.shares()) * n).astype(np.int64)
    bounds[-1] = n
    out = np.empty(n, np.uint8)
    out[order] = np.minimum(np.searchsorted(bounds, np.arange(n), side="right"), pol.num_drop_classes - 1)
    return out


@pytest.mark.parametrize("values", ["random", "few_values", "zeros", "nan"])
def test_drop_classes_equal_a_stable_sort_with_ties_in_packet_order(values):
    """drop_classes finds boundaries by partition, not by sorting; it must give exactly the ranks a
    stable sort gives, ties at a boundary included (all-zero gradients tie everywhere)."""
    rng = np.random.default_rng(7)
    policies = (Policy(), Policy(num_drop_classes=2, drop_thresholds=(10,)),
                Policy(drop_class_shares=(0.0, 0.5, 0.0, 0.5)), Policy(drop_class_shares=(0.7, 0.1, 0.1, 0.1)))
    for _ in range(300):
        n = int(rng.integers(1, 80))
        mags = {"random": rng.random(n), "few_values": rng.integers(0, 3, n).astype(float), "zeros": np.zeros(n),
                "nan": np.where(rng.random(n) < 0.2, np.nan, rng.integers(0, 4, n).astype(float))}[values]
        for pol in policies:
            assert P.drop_classes(mags, pol).tolist() == _classes_by_sorting(mags, pol).tolist(), (mags, pol.shares())
            m32 = mags.astype(np.float32)  # packet_magnitudes' own type: partitioned as it is
            assert P.drop_classes(m32, pol).tolist() == _classes_by_sorting(m32, pol).tolist(), (m32, pol.shares())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", ["l2", "maxabs"])
def test_packet_magnitudes_split_across_threads_equal_one_thread(monkeypatch, dtype, kind):
    """Large messages have their magnitudes computed by several threads; every packet's value
    must be exactly what one thread computes (uneven splits and the short tail included)."""
    x = np.random.default_rng(1).standard_normal(357 * 1001 + 17).astype(dtype)
    monkeypatch.setattr(P, "PARALLEL_MAGNITUDE_ELEMS", 10**12)
    one = P.packet_magnitudes(x, 357, kind)
    monkeypatch.setattr(P, "PARALLEL_MAGNITUDE_ELEMS", 1000)
    monkeypatch.setattr(P, "magnitude_threads", lambda: 3)
    monkeypatch.setattr(P, "_POOL", None)
    split = P.packet_magnitudes(x, 357, kind)
    assert split.shape == (1002,) and np.array_equal(split, one)


@pytest.mark.parametrize("total,p,required", [(100, 0.05, 95), (100, 0.0, 100), (3, 0.05, 3), (0, 0.05, 0),
                                              (1000, 0.1, 900), (7, 0.3, 5)])
def test_completion_rule(total, p, required):
    assert P.required_elements(total, p) == required
    assert P.is_complete(required, total, p)
    assert not P.is_complete(required - 1, total, p) or required == 0


def test_dscp_for_priority():
    pol = Policy()
    assert [P.dscp_for_priority(p, pol) for p in range(8)] == [0, 8, 16, 24, 32, 40, 48, 56]
    with pytest.raises(ValueError):
        P.dscp_for_priority(8, pol)
