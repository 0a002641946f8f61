"""What the LM head's bit width costs in next-token top-1 agreement: the fp32 model's final hidden states
(SmolLM2, torch) through the head as int8 and as int4 blocks (`precision/weight_quant.quantize_rows`, blocks
of `--blocks` values: int8 symmetric, int4 with a float minimum), each on fp32 activations and on int8
activations rounded per block as ONNX Runtime's MatMulNBits accuracy level 4 does, against the fp32 head. Real text:
`--rows` windows of `--length` tokens of the bundled Wikipedia sample, every position.

    .venv/bin/python -m benchmarks.probes.probe_head_bits [--rows 8] [--length 512] [--blocks 32,64]
"""

from __future__ import annotations

import argparse

import numpy as np


def int8_activations(h: np.ndarray, block: int) -> np.ndarray:
    blocks = h.reshape(*h.shape[:-1], -1, block)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0)
    return (np.round(blocks / scale) * scale).reshape(h.shape)


def main() -> None:
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve
    from trtserve.precision.measure import Corpus
    from trtserve.precision.weight_quant import quantize_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--blocks", default="32", help="block sizes to try, comma-separated (weights and int8 "
                        "activations alike, as MatMulNBits blocks both)")
    args = parser.parse_args()
    sizes = [int(b) for b in args.blocks.split(",")]
    source = resolve(args.model)
    model = load_torch_model(source, attention="eager")
    rows = Corpus.wikipedia().rows(load_hf_tokenizer(source.path), args.rows, args.length, special=False)
    head = model.lm_head.weight.detach().numpy()
    heads = {(bits, block): quantize_rows(head, bits, block=block).dequantized()
             for bits in ("int8", "int4") for block in sizes}
    agree: dict[str, list] = {}
    with torch.no_grad():
        for row in rows:
            hidden = model.model(torch.tensor([row])).last_hidden_state[0].numpy()
            reference = (hidden @ head.T).argmax(-1)
            for (bits, block), weight in heads.items():
                for label, x in (("fp32", hidden), ("int8", int8_activations(hidden, block))):
                    agree.setdefault(f"| {bits} | {block} | {label} |", []).append(
                        (x @ weight.T).argmax(-1) == reference)
    print(f"{args.model}: LM head {head.shape[0]} x {head.shape[1]}, {args.rows} x {args.length} Wikipedia tokens, "
          "top-1 agreement with the fp32 head")
    print("| head weights | block | activations | top-1 |\n|---|---:|---|---:|")
    for key, hits in agree.items():
        print(f"{key} {np.concatenate(hits).mean():.2%} |")


if __name__ == "__main__":
    main()
