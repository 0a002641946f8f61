"""The evaluation report, made from results.jsonl alone: Markdown tables and matplotlib PNGs.
Speedup is the torch fp32 baseline's p50 of the same model, batch, length and input over the row's p50."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from trtserve.errors import TrtServeError
from trtserve.eval.runner import ENGINES, RESULTS

REPORT = "report.md"


def load_rows(out: Path) -> list[dict]:
    path = Path(out) / RESULTS
    if not path.is_file():
        raise TrtServeError(f"{path} does not exist: run `trtserve eval --out {out}` first")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted run
    return rows


def with_speedup(rows: list[dict]) -> list[dict]:
    base = {(r["model"], r["batch"], r["sequence"], r["input"]): r["latency_ms"]["p50"]
            for r in rows if r.get("status") == "ok" and r["backend"] == "torch"}
    for r in rows:
        shape = (r["model"], r["batch"], r["sequence"], r["input"])
        if r.get("status") == "ok" and shape in base:
            r["speedup"] = base[shape] / r["latency_ms"]["p50"]
    return rows


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def _grid_size(grid: dict | None) -> int | None:
    if not grid:
        return None
    from trtserve.eval.grid import Grid

    return len(Grid(**grid).configs())


def _mean_gap(rows) -> float:
    """Mean of 1 - worst-token cosine (NaN rows count as a gap of 2, the worst possible)."""
    gaps = [2.0 if r["fidelity"]["worst_row_cosine"] != r["fidelity"]["worst_row_cosine"]
            else 1 - r["fidelity"]["worst_row_cosine"] for r in rows]
    return statistics.mean(gaps) if gaps else float("nan")


def _ratio(real: float, random: float):
    """How many times worse real text is than random ids (None when neither shows anything,
    NaN when one of the two inputs was not measured)."""
    if real != real or random != random:
        return float("nan")
    if not real and not random:
        return None
    return float("inf") if not random else real / random


def _groups(rows, *keys):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return dict(sorted(out.items()))


def summary(rows: list[dict]) -> dict:
    """The headline numbers, also used by the Markdown tables."""
    ok = [r for r in with_speedup(rows) if r.get("status") == "ok"]
    timed = [r for r in ok if r["backend"] in ("onnxruntime", "tensorrt")]
    speed = {f"{m}/{b}/{p}": {"best": max(r["speedup"] for r in g), "median": _median(r["speedup"] for r in g)}
             for (m, b, p), g in _groups([r for r in timed if "speedup" in r], "model", "backend", "precision").items()}
    fidelity = {}
    for (m, b, p), g in _groups([r for r in ok if "fidelity" in r and r["backend"] != "torch"],
                                "model", "backend", "precision").items():
        fid = [r["fidelity"] for r in g]
        fidelity[f"{m}/{b}/{p}"] = {
            "min_cosine": min(f["cosine"] for f in fid),
            "min_worst_token_cosine": min(f["worst_row_cosine"] for f in fid),
            "median_worst_token_cosine": _median(f["worst_row_cosine"] for f in fid),
            "nonfinite_rate": {kind: _median(r["fidelity"]["nonfinite_rate"] for r in g if r["input"] == kind)
                               for kind in ("real", "random")},
            "top1": _median(f.get("top1") for f in fid) if any("top1" in f for f in fid) else None,
            "mean_cosine_gap": {kind: _mean_gap(r for r in g if r["input"] == kind) for kind in ("real", "random")}}
        entry = fidelity[f"{m}/{b}/{p}"]
        entry["real_over_random"] = {name: _ratio(entry[name]["real"], entry[name]["random"])
                                     for name in ("nonfinite_rate", "mean_cosine_gap")}
    memory = {f"{m}/{b}/{p}": {"loaded_mb": _median((r.get("backend_load_bytes") or 0) / 1e6 for r in g),
                                "median_working_mb": _median((r.get("working_bytes") or 0) / 1e6 for r in g),
                                "max_working_mb": max((r.get("working_bytes") or 0) / 1e6 for r in g),
                                "engine_mb": g[0]["engine_bytes"] / 1e6}
              for (m, b, p), g in _groups(ok, "model", "backend", "precision").items()}
    not_run = sorted({f"{r['backend']}: {r['why']}" for r in rows if r.get("status") in ("skipped", "failed")})
    return {"configurations": len(rows), "measured": len(ok), "speedup": speed, "fidelity": fidelity,
            "memory": memory, "not_run": not_run}


def _target_lines(rows: list[dict]) -> list[str]:
    """Per model, backend and policy: the rows that miss the fidelity target their engine was built to."""
    judged = [r for r in rows if r.get("status") == "ok" and "target_misses" in r]
    if not judged:
        return []
    lines = ["", "## Every shape against the engine's own target", "",
             "Each row's fidelity judged by the target its engine's build gate used; random ids by their own "
             "cosine bound, top-1 on real text only. " + _positions(judged), "",
             "| model / backend / policy | shapes | missing the target | first miss |", "|---|---|---|---|"]
    for (m, b, p), g in _groups(judged, "model", "backend", "precision").items():
        missed = [r for r in g if r["target_misses"]]
        first = missed[0]["target_misses"][0] if missed else ""
        lines.append(f"| {m}/{b}/{p} | {len(g)} | {len(missed)} | {first} |")
    return lines


def _positions(rows: list[dict]) -> str:
    """Which positions the rows were judged on: every one, or (rows from before that) a sample per row."""
    sampled = sum(r.get("fidelity_positions") != "every" for r in rows)
    if not sampled:
        return "Every position of every row is judged."
    return (f"{len(rows) - sampled} rows are judged on every position; {sampled} rows, measured by an earlier "
            "runner, on a sample of positions (64 evenly spaced ones at the presets' lengths: a row of 512 "
            "tokens on every 8th).")


def _engine_lines(built: dict) -> list[str]:
    """The engines' build-time fidelity: what each gate measured, worst over its shapes."""
    lines = ["", "## Build-time fidelity (each engine's gate, worst over its shapes)", "",
             "Resident: what a fresh process holds once it loaded the engine's ONNX Runtime graph and ran it on 4 "
             "tokens, measured by the build (`trtserve info`); the Memory table's figures are taken inside this "
             "long-running process. Grid shapes: how many of the gate's shapes were this evaluation's own (its "
             "builds hold each engine to every shape the grid runs for the model, with the same token ids).", "",
             "| model / policy | run | passed | grid shapes | worst-token cos, real | worst-token cos, random "
             "| top-1 | ppl delta | sentence cos, mean | top-10 neighbours | sentiment flips | resident |",
             "|---" * 12 + "|"]
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    for key, entry in built.items():
        for run, w in entry["runs"].items():
            sentences = entry["sentences"].get(run, {})
            flips = sentences.get("sentiment_flips")
            lines.append(f"| {key} | {run} | {'yes' if entry['passed'] else 'no'} | {entry.get('grid_shapes', '')} | "
                         f"{w['token_cosine']:.6f} | "
                         f"{fmt(w.get('random_token_cosine'), '.6f')} | {fmt(w.get('top1'), '.2%')} | "
                         f"{fmt(w.get('ppl_delta'), '.2e')} | {fmt(sentences.get('mean_cosine'), '.6f')} | "
                         f"{fmt(sentences.get('neighbours'), '.1%')} | {'' if flips is None else flips} | "
                         f"{fmt(entry.get('resident_mb'), '.0f')}{'' if entry.get('resident_mb') is None else ' MB'} |")
    return lines


def write_report(out: Path) -> Path:
    out = Path(out)
    rows = with_speedup(load_rows(out))
    facts = summary(rows)
    grid = json.loads((out / "grid.json").read_text()) if (out / "grid.json").is_file() else {}
    plots = _plots(rows, out)
    total = grid.get("configurations") or _grid_size(grid.get("grid"))
    lines = [f"# Evaluation: {grid.get('grid', {}).get('name', out.name)}", "",
             f"{facts['configurations']} of the grid's {total or '?'} configurations recorded, {facts['measured']} "
             "measured (the others skipped or failed, with the reason below). Machine and versions: "
             f"`{json.dumps(grid.get('environment', {}))}`.", "",
             "Speedup is the torch fp32 baseline's p50 latency of the same model, batch, length and input divided "
             "by the row's p50. The fp16-emulation backend runs ONNX Runtime on a graph that rounds every fp16 "
             "node's inputs and outputs to fp16: its latency means nothing, its fidelity predicts an fp16 GPU.", "",
             "## Speedup over torch fp32", "", "| model / backend / policy | best | median |", "|---|---|---|"]
    lines += [f"| {k} | {v['best']:.2f}x | {v['median']:.2f}x |" for k, v in facts["speedup"].items()]
    lines += ["", "## Fidelity against torch fp32", "",
              "| model / backend / policy | min cosine | min worst-token cosine | median worst-token cosine | "
              "NaN/Inf rate real | NaN/Inf rate random | top-1 |", "|---|---|---|---|---|---|---|"]
    for k, v in facts["fidelity"].items():
        top1 = "" if v["top1"] is None else f"{v['top1']:.4f}"
        lines.append(f"| {k} | {v['min_cosine']:.6f} | {v['min_worst_token_cosine']:.6f} | "
                     f"{v['median_worst_token_cosine']:.6f} | {v['nonfinite_rate']['real']:.2e} | "
                     f"{v['nonfinite_rate']['random']:.2e} | {top1} |")
    lines += ["", "## Real text against random token ids", "",
              "How many times larger the NaN/Inf rate and the mean worst-token cosine gap (1 - cosine) are on real "
              "text than on random ids, same shapes (a ratio above 1: random ids underestimate the risk).", "",
              "| model / backend / policy | NaN/Inf rate, real / random | cosine gap, real / random |", "|---|---|---|"]
    for k, v in facts["fidelity"].items():
        if k.split("/")[2] == "fp32":
            continue
        ratios = v["real_over_random"]
        lines.append(f"| {k} | {_fmt_ratio(ratios['nonfinite_rate'])} | {_fmt_ratio(ratios['mean_cosine_gap'])} |")
    lines += ["", "## Memory", "",
              "Loaded: RSS growth when the backend was loaded (weights and runtime). Working: peak RSS during a "
              "configuration above RSS at its start (activations, outputs). ONNX Runtime on the CPU keeps fp16 "
              "weights as fp32 (it has no fp16 GEMM), so fp16 saves file size here, not RSS.", "",
              "| model / backend / policy | loaded | working, median | working, max | engine (model.onnx) |",
              "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['loaded_mb']:.0f} MB | {v['median_working_mb']:.0f} MB | {v['max_working_mb']:.0f} MB | "
              f"{v['engine_mb']:.1f} MB |" for k, v in facts["memory"].items()]
    lines += _target_lines(rows)
    if (out / ENGINES).is_file():
        built = json.loads((out / ENGINES).read_text())
        facts["engines"] = built
        lines += _engine_lines(built)
    if (out / "downstream.json").is_file():
        down = json.loads((out / "downstream.json").read_text())
        facts["downstream"] = down
        lines += ["", "## Downstream accuracy (sentiment head on MiniLM embeddings)", "",
                  f"{down['data']}; {down['head']} (training accuracy {down['train_accuracy_fp32']:.3f}).", "",
                  "| backend / policy | held-out accuracy | predictions that differ from torch fp32 |", "|---|---|---|"]
        lines += [f"| {k} | {v:.3f} | {down['flips_vs_fp32'][k]} |" for k, v in down["accuracy"].items()]
    if facts["not_run"]:
        lines += ["", "## Not run", ""] + [f"- {why}" for why in facts["not_run"]]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    (out / "summary.json").write_text(json.dumps(facts, indent=1))
    (out / REPORT).write_text("\n".join(lines) + "\n")
    return out / REPORT


def _fmt_ratio(value) -> str:
    if value is None:
        return "no NaN/Inf either way"
    return "not measured on both inputs" if value != value else f"{value:.2f}x"


def _plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        raise TrtServeError("plots need matplotlib: pip install 'trtserve[eval]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    made = []
    for model, group in _groups(ok, "model").items():
        model = model[0]
        slug = model.replace("/", "_")
        batch = min(r["batch"] for r in group)
        fig, ax = plt.subplots(figsize=(6, 4))
        for (b, p), g in _groups([r for r in group if r["batch"] == batch and r["input"] == "real"
                                  and r["backend"] != "fp16-emulation"], "backend", "precision").items():
            g = sorted(g, key=lambda r: r["sequence"])
            ax.plot([r["sequence"] for r in g], [r["latency_ms"]["p50"] for r in g], marker="o", label=f"{b} {p}")
        ax.set(xlabel="sequence length", ylabel="p50 latency (ms)", title=f"{model}, batch {batch}, real text",
               xscale="log", yscale="log")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / f"latency-{slug}.png"))

        fast = [r for r in group if r["backend"] == "onnxruntime" and r["precision"] != "fp32" and "speedup" in r
                and r["input"] == "real"]
        if fast:
            policy = max({r["precision"] for r in fast}, key=lambda p: _median(r["speedup"] for r in fast
                                                                                  if r["precision"] == p))
            cells = {(r["batch"], r["sequence"]): r["speedup"] for r in fast if r["precision"] == policy}
            batches, seqs = sorted({b for b, _ in cells}), sorted({s for _, s in cells})
            grid = [[cells.get((b, s), float("nan")) for s in seqs] for b in batches]
            fig, ax = plt.subplots(figsize=(6, 4))
            image = ax.imshow(grid, cmap="viridis", aspect="auto")
            ax.set(xticks=range(len(seqs)), xticklabels=seqs, yticks=range(len(batches)), yticklabels=batches,
                   xlabel="sequence length", ylabel="batch",
                   title=f"{model}: onnxruntime {policy} speedup vs torch fp32")
            for i, row in enumerate(grid):
                for j, value in enumerate(row):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w", fontsize=7)
            fig.colorbar(image)
            made.append(_save(fig, out / f"speedup-{slug}.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        for (b, p), g in _groups([r for r in group if "fidelity" in r and r["backend"] != "torch"],
                                 "backend", "precision").items():
            by_len = _groups(g, "sequence")
            ax.plot([s for (s,) in by_len],
                    [min(r["fidelity"]["worst_row_cosine"] for r in v) for v in by_len.values()],
                    marker="o", label=f"{b} {p}")
        ax.set(xlabel="sequence length", ylabel="min worst-token cosine", title=f"{model}: fidelity vs torch fp32",
               xscale="log")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / f"fidelity-{slug}.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        labels, rss, size = [], [], []
        for (b, p), g in _groups([r for r in group if r["backend"] != "fp16-emulation"],
                                 "backend", "precision").items():
            labels.append(f"{b}\n{p}")
            rss.append(_median(((r.get("backend_load_bytes") or 0) + (r.get("working_bytes") or 0)) / 1e6 for r in g))
            size.append(g[0]["engine_bytes"] / 1e6)
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], rss, width=0.4, label="loaded + median working RSS (MB)")
        ax.bar([x + 0.2 for x in xs], size, width=0.4, label="model.onnx (MB)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set(title=f"{model}: memory per precision")
        ax.legend(fontsize=7)
        made.append(_save(fig, out / f"memory-{slug}.png"))
    return made


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
