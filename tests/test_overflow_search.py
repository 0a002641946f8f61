"""Overflow probe and auto search on the tiny hand-written block (real ONNX Runtime runs)."""

import numpy as np
import onnxruntime as ort

from tests.onnx_graphs import block_graph
from tests.test_precision_pass import block_feeds
from trtserve.precision.overflow import SENTINEL, activation_ranges, flagged
from trtserve.precision.passes import emulation_model
from trtserve.precision.policy import get_policy
from trtserve.precision.search import auto_policy, candidate_units


def run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_probe_flags_the_square_that_overflows_and_ignores_mask_sentinels():
    model = block_graph()
    ranges = activation_ranges(model, [block_feeds(scale=300.0)])
    assert max(ranges.absmax.values()) < SENTINEL  # the mask's fp32 minimum is not an activation
    fp16 = {f["node"]: f for f in flagged(ranges, model, get_policy("fp16"))}
    pow_node = next(n for n, f in fp16.items() if f["op"] == "Pow")
    assert fp16[pow_node]["absmax"] > 65504
    assert fp16[pow_node]["why"] == "output"  # x itself fits fp16 (|x| < 65504), x*x does not
    assert flagged(ranges, model, get_policy("hybrid")) == []  # hybrid keeps the chain fp32


def test_small_inputs_flag_nothing():
    model = block_graph()
    ranges = activation_ranges(model, [block_feeds(scale=1.0)])
    assert flagged(ranges, model, get_policy("fp16")) == []


def test_auto_keeps_the_overflowing_norm_fp32_and_meets_the_target():
    model, feeds = block_graph(), block_feeds(scale=300.0)
    reference = run(model, feeds) - feeds["x"]
    ranges = activation_ranges(model, [feeds])
    flags = {f["node"]: f["absmax"] for f in flagged(ranges, model, get_policy("fp16"))}
    units = candidate_units(model, ranges, flags)
    assert units[0].label.startswith("rmsnorm")  # ranked first: it holds the overflowing square

    def passes(policy):
        delta = run(emulation_model(model, policy), feeds) - feeds["x"]
        cos = (reference * delta).sum() / np.linalg.norm(reference) / np.linalg.norm(delta)
        return bool(cos >= 0.999)

    policy, log, k = auto_policy(model, units, passes)
    assert not log[0]["passed"]  # plain fp16 misses the target
    assert passes(policy) and 0 < k < len(units)
    assert units[0].nodes <= policy.fp32_nodes


def test_gemms_join_the_candidates_when_every_other_unit_fp32_still_misses():
    import pytest

    from trtserve.precision.search import gemm_units

    model, feeds = block_graph(), block_feeds(scale=300.0)
    ranges = activation_ranges(model, [feeds])
    flags = {f["node"]: f["absmax"] for f in flagged(ranges, model, get_policy("fp16"))}
    units = candidate_units(model, ranges, flags)
    gemm_names = {n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")} - policy_of(units)
    assert gemm_names  # GEMMs outside patterns that do not overflow stay fp16: not candidates
    needs = sorted(gemm_names)[0]  # a shape that only this GEMM in fp32 passes

    def passes(policy):
        return needs in policy.fp32_nodes

    with pytest.raises(RuntimeError, match="every candidate"):
        auto_policy(model, units, passes)
    gemms = gemm_units(model, ranges, units)
    assert {u.label.split(":", 1)[1] for u in gemms} == gemm_names
    assert [u.peak for u in gemms] == sorted((u.peak for u in gemms), reverse=True)
    policy, log, k = auto_policy(model, units + gemms, passes, start=len(units))
    assert needs in policy.fp32_nodes and len(units) < k <= len(units) + len(gemms)
    assert log[0] == {"units_fp32": len(units) + len(gemms), "nodes_fp32": len(policy_of(units + gemms)),
                      "passed": True}


def policy_of(units):
    return frozenset().union(*(u.nodes for u in units))


def test_hybrid_set_written_as_auto_names_gives_hybrids_graph():
    from trtserve.precision.passes import apply_policy
    from trtserve.precision.search import hybrid_set

    model, feeds = block_graph(), block_feeds(scale=300.0)
    as_auto = hybrid_set(model)
    assert as_auto.name == "auto" and as_auto.everything and as_auto.fp32_nodes
    _, hybrid_report = apply_policy(model, get_policy("hybrid"))
    _, auto_report = apply_policy(model, as_auto)
    assert auto_report.low_nodes == hybrid_report.low_nodes and auto_report.fp32_nodes == hybrid_report.fp32_nodes
    np.testing.assert_array_equal(run(emulation_model(model, as_auto), feeds),
                                  run(emulation_model(model, get_policy("hybrid")), feeds))


def test_hybrids_set_is_tried_before_any_gemm_goes_fp32():
    from trtserve.precision.search import _beyond_candidates, hybrid_set

    model, feeds = block_graph(), block_feeds(scale=300.0)
    ranges = activation_ranges(model, [feeds])
    flags = {f["node"]: f["absmax"] for f in flagged(ranges, model, get_policy("fp16"))}
    units = candidate_units(model, ranges, flags)
    hybrid = hybrid_set(model).fp32_nodes
    last = {"report": {"failures": ["a shape"]}}
    tried = []

    def only_hybrid(policy):  # a shape that hybrid's set meets and no candidate prefix does
        tried.append(policy.fp32_nodes)
        return policy.fp32_nodes == hybrid

    policy, log, k, out_units, via_hybrid = _beyond_candidates(model, ranges, units, only_hybrid, last)
    assert via_hybrid and policy.fp32_nodes == hybrid and out_units == units and len(tried) == 1
    assert log == [{"units_fp32": "hybrid", "nodes_fp32": len(hybrid), "passed": True}]

    gemm = sorted({n.name for n in model.graph.node if n.op_type == "MatMul"} - policy_of(units))[0]
    policy, log, k, out_units, via_hybrid = _beyond_candidates(
        model, ranges, units, lambda p: gemm in p.fp32_nodes, last)  # hybrid keeps every GEMM fp16: it misses
    assert not via_hybrid and gemm in policy.fp32_nodes and len(out_units) > len(units)
    assert log[0] == {"units_fp32": "hybrid", "nodes_fp32": len(hybrid), "passed": False}
