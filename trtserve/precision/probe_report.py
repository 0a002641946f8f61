"""Markdown form of a real-vs-random probe report."""

from __future__ import annotations

ROWS = (
    ("max_activation", "largest absolute activation in the fp32 graph (mask sentinels excluded)", "{:,.0f}"),
    ("fp16_overflow_nodes", "nodes the policy runs in fp16 whose values leave the fp16 range", "{:d}"),
    ("overflow_value_rate", "share of fp16-node values beyond ±65,504", "{:.2e}"),
    ("nonfinite_rate", "NaN/Inf rate of the fp16-emulated outputs", "{:.2e}"),
    ("diverged_token_rate", "tokens whose fp16-emulated output diverges (cosine < 0.99)", "{:.2%}"),
)


def _ratio(value) -> str:
    if value is None:
        return "– (both 0)"
    return "∞ (random finds none)" if value == "inf" else f"{value:.2f}×"


def to_markdown(model_id: str, report: dict, command: str) -> str:
    real, rand = report["real"], report["random"]
    lines = [
        f"# fp16 risk on real text vs random token ids: {model_id}",
        "",
        f"Policy `{report['policy']}`, {real['sequences']} sequences of {report['length']} tokens of each kind "
        "(real: Wikipedia paragraphs shipped in gensim; random: uniform over the vocabulary, special tokens "
        "excluded). Measured with:",
        "",
        f"    {command}",
        "",
        "| metric | real text | random ids | real / random |",
        "|---|---|---|---|",
    ]
    for key, label, fmt in ROWS:
        lines.append(f"| {label} | {fmt.format(real[key])} | {fmt.format(rand[key])} | "
                     f"{_ratio(report['underestimation'][key])} |")
    lines += ["", "Nodes with the largest out-of-range values on real text:", "",
              "| node | op | largest absolute value | why |", "|---|---|---|---|"]
    for flag in real["worst_nodes"]:
        lines.append(f"| {flag['node']} | {flag['op']} | {flag['absmax']:,.0f} | {flag['why']} |")
    if not real["worst_nodes"]:
        lines.append("| (none) | | | |")
    return "\n".join(lines) + "\n"
