"""`trtserve` command line: build-engine, info, run. Every flag maps to one config field."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trtserve.errors import TrtServeError


def _build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="Hugging Face checkpoint directory, or a bundled model: "
                        "all-MiniLM-L6-v2, SmolLM2-135M-Instruct")
    parser.add_argument("--out", required=True, type=Path, help="engine directory to write (replaced atomically)")
    parser.add_argument("--precision", default="fp32", choices=["fp32"], help="precision policy (default fp32)")
    parser.add_argument("--backend", default="auto", choices=["auto", "onnxruntime"],
                        help="engine backend; auto says which it picked and why")
    parser.add_argument("--max-batch", type=int, default=32, help="largest batch the engine accepts (default 32)")
    parser.add_argument("--max-seq", type=int, default=None,
                        help="longest sequence (decoders: prompt + generated) the engine accepts; "
                        "default: the model's position limit, at most 2048")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=_cmd_build)
    return parser


def _cmd_build(args: argparse.Namespace) -> int:
    from trtserve.engine_builder.build import BuildConfig, build_engine, summary
    from trtserve.progress import set_quiet

    set_quiet(args.quiet)
    cfg = BuildConfig(model=args.model, out=args.out, precision=args.precision, backend=args.backend,
                      max_batch=args.max_batch, max_seq=args.max_seq)
    engine = build_engine(cfg)
    parity = engine.manifest["parity"]
    print(f"engine written to {engine.path}")
    print(f"parity vs torch fp32 ({'passed' if parity['passed'] else 'FAILED'}): {summary(parity)}")
    return 0 if parity["passed"] else 1


def _cmd_info(args: argparse.Namespace) -> int:
    from trtserve.engine_builder.artifact import open_engine_dir
    from trtserve.engine_builder.info import describe_manifest

    engine = open_engine_dir(args.engine_dir, verify=not args.no_verify)
    print(json.dumps(engine.manifest, indent=2) if args.json else describe_manifest(engine))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    backend = load_backend(args.engine_dir, args.backend)
    engine = TextEngine(backend)
    texts = args.text or [_default_text(backend.engine.kind)]
    if backend.engine.kind == "decoder":
        for text in texts:
            print(f"{text}{engine.complete(text, args.max_new_tokens)}")
    else:
        vectors = engine.embed(texts)
        print(f"embeddings: {vectors.shape[0]} x {vectors.shape[1]} (normalised)")
        for i, text in enumerate(texts):
            print(f"[{i}] {text[:70]}")
        if len(texts) > 1:
            print("cosine similarity:")
            for row in vectors @ vectors.T:
                print("  " + " ".join(f"{value:6.3f}" for value in row))
    from trtserve.engine_builder.build import summary

    parity = backend.engine.manifest["parity"]
    print(f"parity vs torch fp32 at build ({'passed' if parity['passed'] else 'FAILED'}): {summary(parity)}")
    backend.close()
    return 0


def _default_text(kind: str) -> str:
    from trtserve.eval.data import wiki_paragraphs

    first = wiki_paragraphs()[0]
    return " ".join(first.split()[:40]) if kind == "decoder" else first


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtserve", description="Build and serve Transformer inference engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    _build_parser(sub.add_parser("build-engine", help="export a checkpoint and build an engine directory"))
    info = sub.add_parser("info", help="print an engine directory's manifest in human form")
    info.add_argument("engine_dir", type=Path)
    info.add_argument("--json", action="store_true", help="print the raw manifest")
    info.add_argument("--no-verify", action="store_true", help="skip checking file sizes and hashes")
    info.set_defaults(func=_cmd_info)
    run = sub.add_parser("run", help="run an engine on text: embeddings for encoders, greedy text for decoders")
    run.add_argument("engine_dir", type=Path)
    run.add_argument("--text", action="append", help="input text (repeat for several); default: a Wikipedia paragraph")
    run.add_argument("--max-new-tokens", type=int, default=32, help="decoders: tokens to generate (default 32)")
    run.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"],
                     help="runtime backend (torch: the fp32 reference)")
    run.set_defaults(func=_cmd_run)
    return parser


def _run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except TrtServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return _run(make_parser(), argv)


def build_engine_main(argv: list[str] | None = None) -> int:
    """The `build-engine` console script: the same command as `trtserve build-engine`."""
    return _run(_build_parser(argparse.ArgumentParser(prog="build-engine")), argv)


if __name__ == "__main__":
    sys.exit(main())
