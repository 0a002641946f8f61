"""Precision written into the graph: the one public call the builder makes (`write_precision` for a
checkpoint's graph, `write_track_precision` for a parallel-track engine's graphs), over the strategies
that stay inside this package:

- float mixing (fp32, fp16, hybrid, auto): the policy's fp32 set written with fp16 casts (passes.py);
  auto first searches its set under fp16 emulation (search.py);
- gguf: the GGUF file's own blocks carried into the graph (gguf_policy.py);
- measured int8/int4: each weight's format from its measured sensitivity (sensitivity.py, quant_policy.py).

Quantized policies try int8-activation plans, fastest first, and int8/int4 keep more of their most
sensitive weights one step safer where the gate misses (`first_passing`, the one loop both engine kinds
use). What is not precision comes in through the `Gate`: the backend step that turns a written portable
graph into the graph that is served, and the engine that is measured.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import TrtServeError
from trtserve.fileio import cache_root, sha256_file
from trtserve.graph_files import copy_graph, load_graph, save_graph
from trtserve.precision.measure import Target
from trtserve.precision.policy import POLICIES, get_policy
from trtserve.progress import say, step

if TYPE_CHECKING:
    from trtserve.models.sources import ModelSource

TRACK_PRECISIONS = ("fp32", "fp16", "hybrid", "int8", "int4")  # of POLICIES, what a track engine takes
# int8 activations of track engines
TRACK_PLANS: tuple[tuple[str, frozenset[str]], ...] = (("every quantized GEMM", frozenset({"*"})),
                                                       ("none", frozenset()))


def check_precision(name: str, source=None, tracks: bool = False) -> None:
    """Refuse a precision this build cannot take, before anything slow runs."""
    if name not in (TRACK_PRECISIONS if tracks else POLICIES):
        if tracks:
            raise TrtServeError(f"--precision {name} is not available for track engines; choose fp32, fp16, hybrid, "
                                f"int8 or int4 (of {', '.join(POLICIES)})")
        raise TrtServeError(f"--precision {name} is not available; choose one of {', '.join(POLICIES)}")
    if source is not None and get_policy(name).weights == "gguf" and source.gguf is None:
        raise TrtServeError(f"--precision gguf reads a GGUF checkpoint's own blocks, and {source.model_id} was not "
                            "converted from a .gguf file; give the .gguf file, or choose another --precision")


def target_for(name: str, kind: ModelKind) -> Target:
    """The target a policy's engines are held to unless --fidelity-target says otherwise: fp32 to parity, the
    others by their weight format (measure.Target.for_weights)."""
    policy = get_policy(name)
    return Target.parity() if policy.name == "fp32" else Target.for_weights(policy.weights, kind)


@dataclass
class Gate:
    """What the builder gives precision for one checkpoint graph."""

    fp32_graph: Path  # the fp32 export
    out: Path  # where the portable graph is written
    source: ModelSource
    harness: object  # run.Harness: the reference model and text, loaded once
    target: Target
    lower: Callable  # (portable graph, int8-activation GEMMs or None, GEMMs with the residual) -> backend entry
    engine: Callable  # (precision section, backend entry, graph sha256) -> the engine dir to measure
    missed: list = field(default_factory=list)  # the tries that missed the target, as the manifest records them


def write_precision(name: str, gate: Gate) -> dict:
    """Write policy `name` into the graph, lower and measure it until an engine meets the target (or every
    try has missed); return that engine's fidelity report. The last `gate.engine` call holds its parts."""
    policy, search_record = get_policy(name), None
    if policy.name == "auto":
        import onnx

        from trtserve.precision.search import search

        with step("auto precision: overflow probe and search under fp16 emulation"):
            policy, search_record = search(onnx.load(str(gate.fp32_graph)), gate.harness)
    strategy = _strategy(policy, gate)
    # the graph on disk, and the last one measured
    state: dict[str, object] = {"written": None, "digest": None, "measured": None}

    def attempt(plan, kept, number: int):
        keep = strategy.keep(plan)
        if number == 0:
            state["measured"] = None
        if (keep, kept) != state["written"]:
            strategy.graph_report = strategy.write(keep, kept)
            state["written"], state["digest"] = (keep, kept), sha256_file(gate.out)
            if number and state["digest"] == state["measured"]:  # the plan keeps those GEMMs fp32 anyway
                say(f"keeping the {kept} most sensitive weights safer changes no weight under this plan")
                return None
            state["measured"] = state["digest"]
        label = (f", int8 activations in {plan.label}" if plan else "") + (
            f", the {kept} most sensitive weights kept safer" if strategy.widens_to(kept) else "")
        with step(f"optimizing the graph with ONNX Runtime{label}"):
            entry = gate.lower(gate.out, plan.int8 if plan else None, plan.residual if plan else frozenset())
        if plan:
            entry.update(int8_activations=plan.label, int8_activations_missed=list(gate.missed))
        return gate.engine(dict(policy.describe(), graph=strategy.graph_report, search=search_record), entry,
                           state["digest"])

    def measure(engine):
        from trtserve.precision.run import measure_engine

        return measure_engine(engine, gate.source, gate.fp32_graph, gate.target, harness=gate.harness)

    def attempt_held(plan, kept, number):  # the screen measures the engine the harness holds
        engine = attempt(plan, kept, number)
        if engine is not None:
            gate.harness.engine = engine
        return engine

    return first_passing(strategy.plans, strategy.widenings, attempt_held, measure, gate.missed, strategy.measured,
                         _screen(gate))


def first_passing(plans: list, widenings: Callable, attempt: Callable, measure: Callable, missed: list,
                  measured: bool, screen: Callable | None = None) -> dict:
    """The plan-by-widening loop: each plan (fastest first) with each widening (`widenings(plan)`, how many of
    the most sensitive weights are kept safer), until the engine `attempt(plan, kept, number)` wrote (None: the
    same graph as the try before) meets the target by `measure(engine)`; a plan whose quick `screen(plan)`
    misses (a summary; None: it passes) is left after its first try. Returns the report of the engine that
    passed, or of the last one tried; `missed` gets the tries that missed, as the manifest records them."""
    from trtserve.precision.run import summary

    report: dict | None = None
    for plan in plans:
        counts = widenings(plan)
        last_plan = plan is plans[-1]
        for number, kept in enumerate(counts):
            engine = attempt(plan, kept, number)
            if engine is None:
                continue
            if screen is not None and not last_plan and number == 0:
                if (screened := screen(plan)) is not None:
                    missed.append({"plan": plan.label, "fidelity": screened})
                    say(f"int8 activations in {plan.label} miss the target: {screened}")
                    break
            report = measure(engine)
            if report["passed"] or (last_plan and number == len(counts) - 1):
                return report
            missed.append({"plan": plan.label, "fidelity": summary(report),
                           **({"kept_safer": kept} if measured else {})})
            say(f"int8 activations in {plan.label}" + (f" with the {kept} most sensitive weights kept safer"
                                                       if measured else "") + f" miss the target: {summary(report)}")
    assert report is not None  # the last plan is never screened out: its first try is measured
    return report


def _screen(gate: Gate) -> Callable:
    """A quick screen of the engine the harness holds: prefill only, the lengths the search measures."""
    from trtserve.precision.run import screen_summary
    from trtserve.precision.search import SEARCH_MAX_LENGTH

    def screen(plan):
        short = [n for n in gate.harness.lengths if n <= SEARCH_MAX_LENGTH]
        with step(f"screening int8 activations in {plan.label}"):
            result = gate.harness.run(decode=False, lengths=short, wide=False)
        return None if result["passed"] else screen_summary(result, short, gate.harness.corpus.name)

    return screen


class _Strategy:
    """How one kind of policy writes its graph: its int8-activation plans, the widenings each plan tries,
    and the rewrite of the fp32 export into `gate.out`."""

    measured = False  # each weight's format chosen here by measurement (so it can be widened)
    graph_report: dict | None  # what the last `write` reported
    plans: list  # the int8-activation plans (activations.Plan; None: the one plan without them)

    def __init__(self, policy, gate: Gate):
        self.policy, self.gate, self.graph_report = policy, gate, None
        self.plans = [None]

    def keep(self, plan) -> frozenset:
        return frozenset()

    def widenings(self, plan) -> list:
        return [None]

    def widens_to(self, kept) -> bool:
        return False

    def write(self, keep: frozenset, kept) -> dict:
        raise NotImplementedError


class _Float(_Strategy):
    """fp32, fp16, hybrid, auto: the policy's fp32 set, the rest fp16, casts between."""

    def write(self, keep, kept) -> dict:
        import onnx

        from trtserve.precision.passes import apply_policy

        if self.policy.name == "fp32":
            copy_graph(self.gate.fp32_graph, self.gate.out)
            return {}
        with step(f"writing the {self.policy.name} precision policy into the graph"):
            mixed, report = apply_policy(load_graph(self.gate.fp32_graph), self.policy)
            save_graph(mixed, self.gate.out)
            del mixed
            onnx.checker.check_model(str(self.gate.out), full_check=True)
        say(f"precision: {self.policy.name}: {sum(report.low_nodes.values())} nodes low, "
            f"{sum(report.fp32_nodes.values())} fp32, {report.casts_inserted} casts, patterns kept fp32: "
            + (", ".join(f"{k} x{v['instances']}" for k, v in report.patterns.items()) or "none (explicit node set)"))
        return report.to_json()


class _Blocked(_Strategy):
    """Quantized weights in blocks: the int8-activation plans of the graph, fastest first."""

    def __init__(self, policy, gate: Gate):
        super().__init__(policy, gate)
        from trtserve.precision.activations import plans

        self.plans = plans(load_graph(gate.fp32_graph, weights=False))  # by structure
        self.blocks = self.choose()  # once, for every plan

    def choose(self):
        """The blocks the weights are written in, chosen once for every plan."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        raise NotImplementedError

    def rewrite(self, model, keep, kept, base):
        """(the graph with the plan's weights written in, its report)."""
        raise NotImplementedError

    def summary(self, report, formats) -> str:
        raise NotImplementedError

    def write(self, keep, kept) -> dict:
        import onnx

        with step(self.label):
            fp32 = self.gate.fp32_graph
            # the structure alone: each weight is read from the export's file as it is rewritten or copied
            model, report = self.rewrite(load_graph(fp32, weights=False), keep, kept, fp32.parent)
            save_graph(model, self.gate.out, base=fp32.parent)
            del model
            onnx.checker.check_model(str(self.gate.out), full_check=True)
        formats = ", ".join(f"{k} x{v}" for k, v in sorted(Counter(
            v["format"] for v in [*report["gemms"].values(), *report["embeddings"].values()]).items()))
        say(self.summary(report, formats))
        return report


class _Gguf(_Blocked):
    """The GGUF file's own blocks; a plan's GEMMs that read fp32 activations keep fp32 weights."""

    def choose(self):
        from trtserve.precision.gguf_blocks import BlockIndex, read_blocks

        return BlockIndex(read_blocks(self.gate.source.gguf))

    def keep(self, plan) -> frozenset:
        return plan.fp32_weights if plan else frozenset()

    @property
    def label(self) -> str:
        assert self.gate.source.gguf is not None  # a GGUF checkpoint's
        return f"carrying the blocks of {self.gate.source.gguf.name} into the graph"

    def rewrite(self, model, keep, kept, base):
        from trtserve.precision.gguf_policy import apply_gguf

        return apply_gguf(model, self.gate.source.gguf, keep, self.blocks, base)

    def summary(self, report, formats) -> str:
        return (f"precision: gguf: {len(report['gemms'])} GEMMs and {len(report['embeddings'])} embeddings read "
                f"GGUF blocks ({formats}), {len(report['fp32'])} weights stay fp32")


class _Measured(_Blocked):
    """int8/int4: each weight's format by its measured sensitivity, widened where the gate misses."""

    measured = True

    def choose(self):
        from trtserve.precision.quant_policy import candidates
        from trtserve.precision.sensitivity import CALIBRATION_LENGTH, CALIBRATION_ROWS, choose

        gate, kind = self.gate, self.gate.source.info.kind
        weights, eight_bit = candidates(load_graph(gate.fp32_graph, weights=False), gate.fp32_graph.parent)
        try:
            rows = gate.harness.corpus.rows(gate.harness.tokenizer, CALIBRATION_ROWS, CALIBRATION_LENGTH,
                                            special=kind != ModelKind.DECODER)
        except ValueError as exc:
            raise TrtServeError(f"--calibration: {exc}; the {self.policy.name} policy measures each weight's "
                                f"sensitivity on {CALIBRATION_ROWS} rows of {CALIBRATION_LENGTH} tokens") from None
        with step(f"{self.policy.name} weights: sensitivity of {len(weights)} weights on {gate.harness.corpus.name}, "
                  "then the mix"):
            choice = choose(lambda: gate.harness.reference, kind, weights, eight_bit, self.policy.weights,
                            gate.target, rows, cache_dir=cache_root() / "sensitivity")
        # the torch model is loaded again for the gate, after the graph is written: never beside the quantizing
        gate.harness.references.release()
        return choice

    def keep(self, plan) -> frozenset:
        return plan.fast if plan else frozenset()

    def widenings(self, plan) -> list[int]:
        return widening_counts(self.blocks, self.policy.weights)

    def widens_to(self, kept) -> bool:
        return kept is not None and kept > self.blocks.kept

    @property
    def label(self) -> str:
        return f"writing {self.policy.name} weights into the graph"

    def rewrite(self, model, keep, kept, base):
        from trtserve.precision.quant_policy import apply_quantized
        from trtserve.precision.sensitivity import widened

        return apply_quantized(model, widened(self.blocks, kept) if self.widens_to(kept) else self.blocks, keep, base)

    def summary(self, report, formats) -> str:
        return f"precision: {self.policy.name}: {formats}, {len(report['fp32'])} weights fp32"


def widening_counts(choice, fmt: str) -> list[int]:
    """How many of the most sensitive weights a plan tries keeping safer, in order (track_quant.escalation):
    only counts that move a weight whose quantization alone changed the output (weights already on their
    format's grid, as SmolLM2's on Q4_1's, measure 0 and gain nothing), and only while some weight keeps the
    policy's own format `fmt` (past that the engine would be another policy's)."""
    from trtserve.precision.sensitivity import widened
    from trtserve.precision.track_quant import escalation

    effective = sum(value > 0 for value in choice.sensitivity.values())  # ranked first
    counts = [choice.kept]
    for kept in escalation(choice.kept, len(choice.sensitivity))[1:]:
        if counts[-1] >= effective or fmt not in widened(choice, kept).formats.values():
            break
        counts.append(kept)
    return counts


def _strategy(policy, gate: Gate) -> _Strategy:
    return {"float": _Float, "gguf": _Gguf}.get(policy.weights, _Measured)(policy, gate)


# -- parallel-track engines: the same policies over every track's graphs ---------------------------------


def rewrite_float(graph, name: str):
    """A graph (onnx ModelProto) with float policy `name` written in (fp32: as it is)."""
    from trtserve.precision.passes import apply_policy

    return apply_policy(graph, get_policy(name))[0]


def track_choice(name: str, model, target: Target | None):
    """For int8/int4 track engines: (each weight's measured format, the formats before any was kept safer,
    the target); None for float policies. Before the export: a bad target or calibration fails fast."""
    if get_policy(name).weights not in ("int8", "int4"):
        return None
    from trtserve.precision.track_quant import choose_formats

    target = target or target_for(name, ModelKind.DECODER)
    choice, low = choose_formats(model, name, target, cache_dir=cache_root() / "sensitivity")
    return choice, low, target


def write_track_precision(name: str, model, chosen: tuple, write_graphs: Callable, engines: Callable) -> dict:
    """Write int8/int4 into every graph of a track engine under each int8-activation plan in turn, keeping more
    of the most sensitive weights safer each time the engines miss (`first_passing`), until they meet the
    target. `write_graphs(rewrite, int8_activations)` writes and lowers each graph with `rewrite(graph,
    name)`; `engines()` opens what was written. Returns the manifest's precision entries, `fidelity` among
    them (the engines that passed, or the last ones tried)."""
    import dataclasses

    from trtserve.precision.activations import Plan
    from trtserve.precision.quant_policy import apply_quantized
    from trtserve.precision.sensitivity import mixed
    from trtserve.precision.track_quant import escalation, fidelity, graph_formats

    choice, low, target = chosen
    plans = [Plan(label, int8) for label, int8 in TRACK_PLANS]
    missed: list[dict]
    last: dict[str, object]
    weights, missed, last = {}, [], {}

    def attempt(plan, kept, number):
        try_choice = dataclasses.replace(choice, formats=graph_formats(mixed(low, choice.sensitivity, kept), model),
                                         kept=kept)

        def rewrite(graph, graph_name):
            graph, report = apply_quantized(graph, try_choice, plan.int8)
            weights[graph_name] = {kind: report[kind] for kind in ("gemms", "embeddings", "fp32")}
            return graph

        write_graphs(rewrite, plan.int8)
        last.update(plan=plan.label, kept=kept)
        return engines()

    report = first_passing(plans, lambda plan: escalation(choice.kept, len(choice.sensitivity)), attempt,
                           lambda engine: fidelity(engine, model, target), missed, measured=True)
    formats = [entry["format"] for graph in weights.values() for kind in ("gemms", "embeddings")
               for entry in graph[kind].values()]
    return {"formats": _format_counts(formats, weights), "graph": weights, "int8_activations": last["plan"],
            "int8_activations_missed": missed, "calibration": choice.whole, "kept_safer": last["kept"],
            "kept_safer_by_calibration": choice.kept, "fidelity": report}


def _format_counts(formats: list, weights: dict) -> dict:
    """How many weights (GEMMs and tables, over every graph) have each format, fp32 ones included."""
    counts: dict[str, int] = {}
    for fmt in formats + ["fp32"] * sum(len(graph["fp32"]) for graph in weights.values()):
        counts[fmt] = counts.get(fmt, 0) + 1
    return counts
