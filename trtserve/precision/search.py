"""The auto policy: starting from fp16, the smallest prefix of ranked fp32 candidates that meets
the fidelity target under fp16 emulation on calibration text.

Candidates are units (a whole RMSNorm chain, the rotary chain, the mask chain, one softmax, one
node), ranked by the overflow probe (units holding a node whose values leave the fp16 range come
first, largest first), then by sensitivity class, then by activation magnitude. The prefix length
is found by bisection, so a model needs about log2(units) fidelity runs.

When a shape misses even with every candidate fp32, hybrid's fp32 set is tried next (every GEMM fp16), and
only if it misses too do the fp16 GEMMs become candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import TrtServeError
from trtserve.precision.passes import find_patterns
from trtserve.precision.policy import FP32_OPS, GEMM_OPS, Policy, get_policy
from trtserve.progress import say

SEARCH_MAX_LENGTH = 512  # the bisection runs on lengths up to this; the result is confirmed on all
CLASS_ORDER = {"attention_mask": 0, "rotary": 1, "rmsnorm": 2, "LayerNormalization": 2, "Softmax": 3}


class Unmet(RuntimeError):
    """Even with every candidate unit in fp32 the target is missed."""


@dataclass(frozen=True)
class Unit:
    label: str
    nodes: frozenset
    flagged_peak: float  # largest out-of-range activation among its nodes (0: none)
    klass: int
    peak: float


def _peaks(ranges) -> dict[str, float]:
    """Node -> the largest absolute value among its outputs on the probe."""
    peak_of: dict[str, float] = {}
    for tensor, node in ranges.producer.items():
        peak_of[node] = max(peak_of.get(node, 0.0), ranges.absmax.get(tensor, 0.0))
    return peak_of


def candidate_units(model, ranges, flagged_nodes: dict[str, float]) -> list[Unit]:
    from trtserve.precision.passes import name_nodes

    name_nodes(model.graph)
    peak_of = _peaks(ranges)
    units: list[Unit]
    taken: set[str]
    units, taken = [], set()

    def add(label: str, nodes: set | frozenset, klass: int):
        nodes = frozenset(nodes) - taken
        if not nodes:
            return
        taken.update(nodes)
        flagged = max((flagged_nodes.get(n, 0.0) for n in nodes), default=0.0)
        units.append(Unit(label, nodes, flagged, klass, max(peak_of.get(n, 0.0) for n in nodes)))

    for name, instances in find_patterns(model, ("attention_mask", "rotary", "rmsnorm")).items():
        for i, nodes in enumerate(instances):
            add(f"{name}[{i}]", nodes, CLASS_ORDER[name])
    for node in model.graph.node:
        if node.op_type in GEMM_OPS and node.name not in flagged_nodes:
            continue  # fp16 GEMMs are the point of the policy; only an overflowing one is a candidate
        if node.name in peak_of or node.op_type in FP32_OPS:
            klass = CLASS_ORDER.get(node.op_type, 4 if node.op_type in FP32_OPS else 5)
            add(f"{node.op_type}:{node.name}", {node.name}, klass)
    return sorted(units, key=lambda u: (u.flagged_peak == 0, -u.flagged_peak, u.klass, -u.peak))


def gemm_units(model, ranges, units: list[Unit]) -> list[Unit]:
    """The fp16 GEMMs that are not candidates yet, one unit each, largest activation first: the last
    resort when a shape misses even with every other candidate fp32 (appended, so that a prefix of
    the first ranking stays a prefix)."""
    peak_of = _peaks(ranges)
    taken = frozenset().union(*(u.nodes for u in units))
    extra = [Unit(f"{n.op_type}:{n.name}", frozenset({n.name}), 0.0, len(CLASS_ORDER) + 2, peak_of.get(n.name, 0.0))
             for n in model.graph.node if n.op_type in GEMM_OPS and n.name not in taken]
    return sorted(extra, key=lambda u: -u.peak)


def policy_with(units: list[Unit], k: int) -> Policy:
    """The auto policy keeping the first `k` units fp32."""
    base = get_policy("auto")
    return Policy(**{**base.__dict__, "fp32_nodes": frozenset().union(*(u.nodes for u in units[:k]))})


def hybrid_set(model) -> Policy:
    """Hybrid's choice written as an auto policy: fp16 everywhere except the nodes hybrid runs in fp32 (its
    norm, rotary and mask chains, softmax, reductions and the elementwise ops between them), named."""
    from trtserve.precision.passes import plan_policy

    _, index, low, _, _ = plan_policy(model, get_policy("hybrid"))
    fp32 = frozenset(n.name for n in index.g.node if not low[n.name]
                     and any(index.is_float(t) for t in [*n.input, *n.output]))
    return Policy(**{**get_policy("auto").__dict__, "fp32_nodes": fp32})


def _beyond_candidates(model, ranges, units: list[Unit], everywhere, last: dict):
    """Every candidate unit in fp32 still misses a shape. Hybrid's set (every GEMM fp16) is tried next, then
    the fp16 GEMMs join the candidates. Returns (policy, log, k, units, whether hybrid's set was taken)."""
    hybrid = hybrid_set(model)
    if everywhere(hybrid):
        say(f"auto: hybrid's set ({len(hybrid.fp32_nodes)} nodes fp32, every GEMM fp16) meets every shape")
        return hybrid, [{"units_fp32": "hybrid", "nodes_fp32": len(hybrid.fp32_nodes), "passed": True}], 0, units, True
    tried = [{"units_fp32": "hybrid", "nodes_fp32": len(hybrid.fp32_nodes), "passed": False}]
    gemms = gemm_units(model, ranges, units)
    say(f"auto: every candidate unit in fp32 and hybrid's set still miss ({last['report']['failures'][0]}); "
        f"the {len(gemms)} fp16 GEMMs join the candidates")
    try:
        policy, more, k = auto_policy(model, units + gemms, everywhere, start=len(units))
    except Unmet:
        raise TrtServeError(f"auto: no fp32 node set meets the fidelity target on every shape: "
                            f"{'; '.join(last['report']['failures'][:3])}. Use --precision hybrid or fp32, "
                            "or relax --fidelity-target") from None
    return policy, tried + more, k, units + gemms, False


def auto_policy(model, units: list[Unit], passes, start: int = 0) -> tuple[Policy, list[dict], int]:
    """Bisect the number of leading units kept fp32; `passes(policy)` runs one fidelity check.

    `start` is a prefix length already known to miss the target (0: try plain fp16 first)."""
    log = []

    def policy_for(k: int) -> Policy:
        return policy_with(units, k)

    def check(k: int) -> bool:
        ok = passes(policy_for(k))
        log.append({"units_fp32": k, "nodes_fp32": len(policy_for(k).fp32_nodes), "passed": ok})
        say(f"auto: {k} of {len(units)} candidate units in fp32 -> {'meets' if ok else 'misses'} the target")
        return ok

    if start == 0 and check(0):
        return policy_for(0), log, 0
    if not check(len(units)):
        raise Unmet("even with every candidate in fp32 the target is missed")
    low, high = start, len(units)  # check(low) fails, check(high) passes
    while high - low > 1:
        mid = (low + high) // 2
        if check(mid):
            high = mid
        else:
            low = mid
    return policy_for(high), log, high


def search(fp32_model, harness, probe_length: int = 128) -> tuple[Policy, dict]:
    """Probe on calibration text, rank candidates, bisect under fp16 emulation."""
    import numpy as np

    from trtserve.precision.measure import random_ids
    from trtserve.precision.overflow import activation_ranges, flagged
    from trtserve.precision.probe import probe_feeds

    info_kind = harness.kind
    names = [v.name for v in fp32_model.graph.input]
    length = min(probe_length, max(harness.lengths))
    rows = np.array(harness.corpus.rows(harness.tokenizer, 4, length, special=info_kind != ModelKind.DECODER), np.int64)
    past = None
    if info_kind == ModelKind.DECODER:
        spec = next(v for v in fp32_model.graph.input if v.name.startswith("past_key_values."))
        dims = spec.type.tensor_type.shape.dim
        past = (dims[1].dim_value, dims[3].dim_value)
    vocab = harness.engine.manifest.model.architecture.vocab_size
    noise = random_ids(vocab, np.random.default_rng(0), (2, length))
    # calibrated on real text and on random ids: random ids reach activations real text does not
    feeds = [probe_feeds(info_kind, batch, names, past) for batch in (rows[0:2], rows[2:4], noise)]
    ranges = activation_ranges(fp32_model, feeds)
    flags = {f["node"]: f["absmax"] for f in flagged(ranges, fp32_model, get_policy("fp16"))}
    units = candidate_units(fp32_model, ranges, flags)
    record_units = len(units)
    say(f"auto: {len(flags)} nodes overflow fp16 on calibration text and random ids; "
        f"{len(units)} candidate units ranked")
    # Bisect on real text at the shorter lengths (fast), then confirm on every length and the wide shapes
    # (random ids, batch 8, padded rows); if that misses, bisect again above the prefix found, on all of them.
    short = [n for n in harness.lengths if n <= SEARCH_MAX_LENGTH] or harness.lengths[:1]
    try:
        policy, log, k = auto_policy(fp32_model, units, lambda p: harness.emulated(
            fp32_model, p, decode=False, lengths=short, wide=False)["passed"])
        missed = harness.emulated(fp32_model, policy, decode=False)["failures"]
    except Unmet:  # every candidate fp32 misses on the short real text already: go on to all shapes
        log, k = [], len(units)
        missed = [f"every candidate unit in fp32 misses on real text up to {max(short)} tokens"]
    via_hybrid = False
    if missed:
        say(f"auto: {k} units fp32 miss {len(missed)} checks (e.g. {missed[0]}); searching on every length and "
            "shape")
        last = {}

        def everywhere(p) -> bool:
            last["report"] = harness.emulated(fp32_model, p, decode=False)
            return last["report"]["passed"]

        try:
            policy, more, k = auto_policy(fp32_model, units, everywhere, start=k)
        except Unmet:  # every candidate fp32 still misses: hybrid's set, then the fp16 GEMMs
            log.append({"units_fp32": len(units), "nodes_fp32": len(policy_with(units, len(units)).fp32_nodes),
                        "passed": False})
            policy, more, k, units, via_hybrid = _beyond_candidates(fp32_model, ranges, units, everywhere, last)
        log += more
    record = {
        "probe_tokens": int(rows.size),
        "flagged_nodes": len(flags),
        "candidate_units": record_units,
        "gemm_units_added": len(units) - record_units,  # GEMMs that joined when a shape missed without them
        "units_kept_fp32": [u.label for u in units[:k]] if not via_hybrid else [],
        "hybrid_set": via_hybrid,  # every candidate fp32 missed and hybrid's fp32 set met every shape
        "evaluations": log,
        "confirmation_missed": missed,  # what the first prefix missed beyond the search's own cases
    }
    return policy, record
