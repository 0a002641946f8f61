"""Where a served graph's resident memory goes: the parts of what `trtserve info` reports as "resident once
loaded and run" (a fresh process, the graph loaded and run on 4 tokens, resident set after minus before).

Each part is measured in its own fresh process, 1 thread:
- ONNX Runtime alone: a one-node graph loaded and run (library pages a first run touches, a session's heap);
- session structures: the engine's graph loaded with kernel prepacking off (nodes, kernels, small
  initializers; no weight copies), minus ONNX Runtime alone;
- prepacked weight copies: the heap the graph takes with prepacking on, minus with it off (MatMul and
  MatMulNBits repack their weights at load and keep the copies);
- weights-file pages: resident pages of the mapped `<graph>.data` once the run is done (/proc/self/smaps),
  weights read in place (block scales, a table's rows looked up);
- the rest: the total minus the parts above (activations of the run, code pages its kernels touched).

The graph's weights by what reads them are listed too (bytes in the file).

    .venv/bin/python -m benchmarks.probes.resident_parts --engine engines/smollm2-int4 [--graph model.ort.onnx]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

_MEASURE = r"""
import json, os, sys, numpy as np, onnxruntime as ort
from onnx import helper, TensorProto
def status():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon", "RssFile")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out
def mapped(suffix):
    total, path = 0, None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header line
            path = parts[5] if len(parts) >= 6 else ""
        elif line.startswith("Rss:") and path and path.endswith(suffix):
            total += int(parts[1]) * 1024
    return total
graph, prepack = sys.argv[1], sys.argv[2] == "1"
before = status()
options = ort.SessionOptions(); options.intra_op_num_threads = 1; options.log_severity_level = 3
if not prepack:
    options.add_session_config_entry("session.disable_prepacking", "1")
if graph == "-":
    node = helper.make_node("Relu", ["x"], ["y"])
    model = helper.make_model(helper.make_graph([node], "g",
                                                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
else:
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
loaded = status()
def dim(d): return d if isinstance(d, int) else 0 if "past" in str(d) else 1 if "batch" in str(d) else 4
feeds = {i.name: np.ones([dim(d) for d in i.shape], np.int64 if "int64" in i.type else np.int32 if "int32" in i.type
                         else np.float32) for i in session.get_inputs()}
session.run(None, feeds)
ran = status()
print(json.dumps({"loaded_anon": loaded["RssAnon"] - before["RssAnon"], "anon": ran["RssAnon"] - before["RssAnon"],
                  "file": ran["RssFile"] - before["RssFile"], "data_pages": mapped(".data")}))
"""


def measure(graph: str, prepack: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", _MEASURE, graph, "1" if prepack else "0"], capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def weights_by_reader(graph: Path) -> Counter:
    """Initializer bytes by the op (and input slot) that reads them; MatMulNBits by its bit width."""
    import onnx
    from onnx import helper

    from trtserve.engine_builder.onnxruntime import initializer_bytes

    model = onnx.load(str(graph), load_external_data=False)
    sizes = initializer_bytes(model)
    parts: Counter = Counter()
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        for slot, name in enumerate(node.input):
            if name in sizes:
                op = f"MatMulNBits {attrs.get('bits')}-bit, level {attrs.get('accuracy_level', 0)}" \
                    if node.op_type == "MatMulNBits" else node.op_type
                parts[f"{op}, input {slot}"] += sizes.pop(name)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, required=True)
    parser.add_argument("--graph", default="model.ort.onnx")
    args = parser.parse_args()
    graph = args.engine / args.graph
    mib = 2 ** 20
    alone = measure("-", True)
    unpacked = measure(str(graph), False)
    packed = measure(str(graph), True)
    total = packed["anon"] + packed["file"]
    parts = {
        "ONNX Runtime alone": alone["anon"] + alone["file"],
        "session structures": unpacked["loaded_anon"] - alone["loaded_anon"],
        "prepacked weight copies": packed["loaded_anon"] - unpacked["loaded_anon"],
        "weights-file pages": packed["data_pages"],
    }
    parts["the rest"] = total - sum(parts.values())
    print(f"{graph}: resident once loaded and run {total / 1e6:.1f} MB ({total / mib:.1f} MiB)")
    print("| part | MB | MiB |\n|---|---:|---:|")
    for name, size in parts.items():
        print(f"| {name} | {size / 1e6:.1f} | {size / mib:.1f} |")
    print("\nweights in the file, by reader (0.1 MB and more):\n| read by | MB |\n|---|---:|")
    for name, size in sorted(weights_by_reader(graph).items(), key=lambda kv: -kv[1]):
        if size >= 50_000:
            print(f"| {name} | {size / 1e6:.1f} |")


if __name__ == "__main__":
    main()
