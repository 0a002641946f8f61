import numpy as np
import pytest

from trtserve.precision.fidelity import compare, cosine, nonfinite_count, perplexity, top1_agreement, worst_row_cosine
from trtserve.precision.measure import Target


def test_identical_arrays_are_perfect():
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype(np.float32)
    metrics = compare(x, x.copy())
    assert metrics["max_abs_error"] == 0.0 and metrics["nonfinite"] == 0
    assert abs(metrics["cosine"] - 1) < 1e-12 and abs(metrics["worst_row_cosine"] - 1) < 1e-12


def test_worst_row_cosine_finds_the_one_bad_row():
    ref = np.ones((4, 3))
    out = ref.copy()
    out[2] = [1, -1, 0]
    assert worst_row_cosine(ref, out) == 0.0
    assert abs(cosine(ref, out) - 9 / np.sqrt(12 * 11)) < 1e-12  # the flattened cosine hides it


def test_uniform_logits_have_perplexity_equal_to_vocab_size():
    logits = np.zeros((2, 6, 50))
    ids = np.arange(12).reshape(2, 6)
    assert abs(perplexity(logits, ids, np.ones_like(ids)) - 50) < 1e-9


def test_perplexity_ignores_padded_positions():
    rng = np.random.default_rng(1)
    logits, ids = rng.normal(size=(1, 8, 20)), rng.integers(0, 20, (1, 8))
    mask = np.ones_like(ids)
    padded_logits = np.concatenate([rng.normal(size=(1, 3, 20)), logits], 1)
    padded_ids = np.concatenate([np.zeros((1, 3), int), ids], 1)
    padded_mask = np.concatenate([np.zeros((1, 3), int), mask], 1)
    assert abs(perplexity(logits, ids, mask) - perplexity(padded_logits, padded_ids, padded_mask)) < 1e-12


def test_top1_agreement_and_nonfinite_count():
    a = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    b = np.array([[0.0, 1.0], [0.1, 0.9], [0.2, 0.8]])
    assert top1_agreement(a, b) == 2 / 3
    assert nonfinite_count(np.array([1.0, np.nan, np.inf, -np.inf])) == 3


def test_a_nan_row_makes_the_worst_row_cosine_nan_not_one():
    ref = np.ones((3, 4))
    out = ref.copy()
    out[1, 2] = np.nan
    assert np.isnan(worst_row_cosine(ref, out))
    assert worst_row_cosine(np.zeros((1, 4)), np.ones((1, 4))) == 0.0


def test_sentence_metrics_are_checked_only_where_the_target_asks():
    from trtserve.precision.measure import Target, failures

    report = {"cases": {}, "sentences": {"mean_cosine": 0.9990, "worst_cosine": 0.99, "neighbours": 0.93,
                                         "sentiment_flips": 2, "sentiment_held_out": 60}}
    assert failures(report, Target()) == []
    missed = failures(report, Target.for_weights("int8", "encoder"))
    assert missed == ["sentences: mean sentence cosine 0.999 < 0.9995",
                      "sentences: top-10 neighbour agreement 0.93 < 0.95",
                      "sentences: sentiment predictions changed 2 > 1"]
    report["sentences"]["mean_cosine"] = float("nan")
    assert "mean sentence cosine nan" in failures(report, Target(min_mean_cosine=0.9))[0]
    assert Target.parse("neighbours=0.9,flips=0,mean_cosine=0.999") == Target(min_neighbours=0.9, max_flips=0,
                                                                              min_mean_cosine=0.999)


@pytest.mark.parametrize("target", [Target(), Target.parity(), Target.for_weights("int8", "encoder"),
                                    Target.for_weights("int4", "decoder"), Target.parse("random_token_cosine=0.9994")])
def test_a_target_written_for_the_rebuild_command_reads_back_the_same(target):
    assert Target.parse(target.text()) == target


def testneighbour_agreement_counts_shared_top10_neighbours():
    from trtserve.precision.measure import neighbour_agreement

    x = np.random.default_rng(0).standard_normal((40, 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert neighbour_agreement(x, x) == 1.0
    y = np.random.default_rng(1).standard_normal((40, 8))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    assert neighbour_agreement(x, y) < 0.6


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_a_case_tallied_a_chunk_of_positions_at_a_time_equals_the_whole(chunk):
    """The gate never holds vocabulary x length x rows of logits: chunks of positions give the same case."""
    from trtserve.precision.measure import LogitsCase, logits_case

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, (3, 40))
    mask = np.ones_like(ids)
    mask[1, :9], mask[2, :31] = 0, 0  # left padding, one row padded across several chunks
    ref = rng.normal(size=(3, 40, 50)).astype(np.float32)
    out = ref + rng.normal(scale=0.3, size=ref.shape).astype(np.float32)
    out[0, 5, 7] = np.nan  # a broken value counts once, wherever its chunk falls
    whole = logits_case(ref, out, ids, mask, real=True)
    case = LogitsCase(ids, mask, real=True)
    for start in range(0, 40, chunk):
        case.add(start, ref[:, start:start + chunk], out[:, start:start + chunk])
    chunked = case.result()
    keep = mask.astype(bool)
    assert whole["top1_agreement"] == top1_agreement(ref[keep], out[keep])
    assert whole["perplexity_engine"] != whole["perplexity_engine"]  # NaN logits: no perplexity
    assert chunked["logits"]["nonfinite"] == whole["logits"]["nonfinite"] == 1
    clean = out.copy()
    clean[0, 5, 7] = 0.0
    whole, case = logits_case(ref, clean, ids, mask, real=True), LogitsCase(ids, mask, real=True)
    for start in range(0, 40, chunk):
        case.add(start, ref[:, start:start + chunk], clean[:, start:start + chunk])
    chunked = case.result()
    assert whole["perplexity_torch"] == pytest.approx(perplexity(ref, ids, mask), rel=1e-12)
    assert whole["perplexity_engine"] == pytest.approx(perplexity(clean, ids, mask), rel=1e-12)
    for key in ("top1_agreement", "perplexity_torch", "perplexity_engine", "tokens"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-12)
    for key, value in whole["logits"].items():
        assert chunked["logits"][key] == pytest.approx(value, rel=1e-12)
