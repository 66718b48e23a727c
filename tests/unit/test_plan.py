import pytest

from hvdp.reduce.plan import CompressionPolicy, make_plan


def test_small_excluded_and_nonfloat_tensors_stay_plain():
    pol = CompressionPolicy(min_elements=100, exclude=("*.bias",), fusion_threshold_bytes=4000)
    names = ["a.weight", "a.bias", "b.weight", "c.weight", "steps"]
    plan = make_plan(names, [500, 500, 50, 600, 1000], [True, True, True, True, False], pol, True)
    assert plan.plain == (1, 2, 4)
    # reverse order (backward order), 4000 bytes per bucket: c (2400 B) then a (2000 B) apart
    assert plan.buckets == ((3,), (0,))


def test_fusion_groups_until_threshold_and_no_compression_means_all_plain():
    pol = CompressionPolicy(min_elements=1, fusion_threshold_bytes=4 * 300)
    plan = make_plan(list("abcd"), [100, 100, 100, 100], [True] * 4, pol, True)
    assert plan.buckets == ((3, 2, 1), (0,))
    assert make_plan(list("ab"), [10, 10], [True, True], pol, False).buckets == ()


def test_policy_validation_and_env(monkeypatch):
    with pytest.raises(ValueError, match="warmup_steps"):
        CompressionPolicy(warmup_steps=-1)
    monkeypatch.setenv("HVDP_MIN_COMPRESS_ELEMENTS", "7")
    assert CompressionPolicy().min_elements == 7
    monkeypatch.setenv("HVDP_MIN_COMPRESS_ELEMENTS", "x")
    with pytest.raises(ValueError, match="HVDP_MIN_COMPRESS_ELEMENTS"):
        CompressionPolicy()
    assert CompressionPolicy(exclude="*norm*", min_elements=0).exclude == ("*norm*",)


def test_the_first_bucket_is_smaller_so_an_exchange_starts_early_in_backward():
    # 3.5 MiB of tensors: the default 1 MiB first bucket holds the last ones (backward's first),
    # the rest fit in one 16 MiB bucket
    numels = [2**18, 2**17, 2**18, 2**17, 2**17]  # 1, 0.5, 1, 0.5, 0.5 MiB of float32
    names = [f"t{i}" for i in range(5)]
    plan = make_plan(names, numels, [True] * 5, CompressionPolicy(), True)
    assert plan.buckets == ((4, 3), (2, 1, 0))
    assert CompressionPolicy().first_bucket_limit == 2**20
    # 0: as large as the others (one bucket); never larger than fusion_threshold_bytes
    assert make_plan(names, numels, [True] * 5, CompressionPolicy(first_bucket_bytes=0), True).buckets == \
        ((4, 3, 2, 1, 0),)
    small = CompressionPolicy(fusion_threshold_bytes=2**19)
    assert small.first_bucket_limit == 2**19
    assert make_plan(names, numels, [True] * 5, small, True).buckets == ((4,), (3,), (2,), (1,), (0,))
    # a tensor larger than the first bucket is a bucket of its own
    assert make_plan(names, numels[:4] + [2**19], [True] * 5, CompressionPolicy(), True).buckets == \
        ((4,), (3, 2, 1, 0))
    with pytest.raises(ValueError, match="first_bucket_bytes"):
        CompressionPolicy(first_bucket_bytes=-2)
