"""`trtserve` command line: build-engine, info, fidelity, probe, serve, run, eval, train-pt, healthcheck, doctor.
Every flag maps to one config field."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from trtserve import __version__
from trtserve.engine_builder import BACKENDS, PRECISIONS  # one list for build-engine and serve
from trtserve.errors import TrtServeError

if TYPE_CHECKING:
    from trtserve.engine_dir.kinds import ModelKind


def _build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", help="Hugging Face checkpoint directory, a .gguf file (llama family), or a "
                        "bundled model: all-MiniLM-L6-v2, SmolLM2-135M-Instruct")
    parser.add_argument("--out", required=True, type=Path, help="engine directory to write (replaced atomically)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="precision policy written into the graph: fp32 (default); fp16 (every op that "
                        "can be); hybrid (fp16 GEMMs, fp32 softmax/norms/reductions/rotary/mask); auto "
                        "(fp16 plus the smallest ranked set of fp32 nodes that meets the fidelity target); "
                        "gguf (a GGUF checkpoint's own Q4_1/Q8_0 blocks in its GEMMs and embeddings, not "
                        "re-quantized); int8, int4 (GEMM and embedding weights quantized in blocks of 32: int8 "
                        "symmetric, int4 with a float minimum per block; the most sensitive weights, measured one "
                        "by one on the calibration text, kept at 8 bits (int4) or fp32 (int8) as the fidelity "
                        "target needs). A parallel-track checkpoint takes fp32, fp16, hybrid, int8 and int4, "
                        "measured on the held-out part of its training text")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="text file to measure fidelity on (default: bundled Wikipedia sample)")
    parser.add_argument("--fidelity-target", default="",
                        help="override targets, e.g. cosine=0.9998,token_cosine=0.999,top1=0.995,ppl_delta=0.005")
    parser.add_argument("--allow-low-fidelity", action="store_true",
                        help="write the engine even if it misses the fidelity target")
    parser.add_argument("--confirm-grid", default=None, metavar="PRESET|FILE",
                        help="also hold the engine to its target on every shape of an evaluation grid (a preset "
                        "such as paper, or a grid TOML file) for this model, with the token ids `trtserve eval` "
                        "feeds; if a shape misses, auto searches again and int8/int4 keep more of their most sensitive "
                        "weights safer")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="engine backend; auto says which it picked and why (tensorrt where TensorRT and a "
                        "GPU are found; for encoders and cross-encoders, OpenVINO is also measured where installed "
                        "and served where it met the target and was faster). tensorrt adds a TensorRT plan beside "
                        "the ONNX Runtime graph; openvino measures OpenVINO (encoders and cross-encoders) and serves "
                        "it wherever it meets the target")
    trt = parser.add_argument_group("TensorRT (with --backend tensorrt)")
    trt.add_argument("--workspace-mib", type=int, default=None, help="memory-pool limit for tactics (MiB)")
    trt.add_argument("--timing-cache", type=Path, default=None,
                     help="persistent timing cache file (default: one per TensorRT version in the cache dir)")
    trt.add_argument("--version-compatible", action="store_true", help="plan loadable by later TensorRT versions")
    trt.add_argument("--hardware-compatibility", default="none",
                     choices=["none", "ampere_plus", "same_compute_capability"],
                     help="full TensorRT: build for a family of GPUs instead of this one")
    trt.add_argument("--compute-capability", action="append", default=[],
                     help="TensorRT-RTX: a target GPU, e.g. 8.6 (repeat for several; default: portable)")
    parser.add_argument("--max-batch", type=int, default=32, help="largest batch the engine accepts (default 32)")
    parser.add_argument("--max-seq", type=int, default=None,
                        help="longest sequence (decoders: prompt + generated) the engine accepts; "
                        "default: the model's position limit, at most 2048")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=_cmd_build)
    return parser


def _cmd_build(args: argparse.Namespace) -> int:
    from trtserve.engine_builder.build import BuildConfig, build_engine
    from trtserve.precision.run import summary
    from trtserve.progress import set_quiet

    set_quiet(args.quiet)
    from trtserve.precision.measure import Target

    try:
        target = Target.parse(args.fidelity_target) if args.fidelity_target else None
    except (ValueError, TypeError) as exc:
        raise TrtServeError(f"--fidelity-target {args.fidelity_target!r}: {exc}") from None
    shapes, seed = _confirm_grid(args.confirm_grid) if args.confirm_grid else ((), 0)
    cfg = BuildConfig(model=args.model, out=args.out, precision=args.precision, backend=args.backend,
                      max_batch=args.max_batch, max_seq=args.max_seq, calibration=args.calibration,
                      fidelity_target=target, allow_low_fidelity=args.allow_low_fidelity,
                      confirm_grid=args.confirm_grid, confirm_shapes=shapes, confirm_seed=seed,
                      trt=_trt_options(args))
    engine = build_engine(cfg)
    if engine.manifest.parallel_tracks is not None:
        pt = engine.manifest.parallel_tracks
        print(f"track-sharded engine written to {engine.path}: {pt.tracks} tracks x {pt.segments} segments, "
              f"{pt.sync.per_forward} all-reduce(s) per forward")
        assert engine.manifest.parity is not None  # every track engine's
        print(f"parity vs torch fp32 (all tracks in one process): max abs error "
              f"{engine.manifest.parity.max_abs_error:.2e}")
        if engine.manifest.fidelity is not None:
            print(f"fidelity vs torch fp32 ({args.precision}): {summary(engine.manifest.fidelity)}")
        return 0
    print(f"engine written to {engine.path}")
    assert engine.manifest.precision is not None  # every checkpoint engine's
    print(f"fidelity vs torch fp32 ({engine.manifest.precision.policy}): {summary(engine.manifest.fidelity)}")
    return 0


def _confirm_grid(grid: str) -> tuple[tuple, int]:
    """The (model, input, batch, length) shapes of an evaluation preset or grid file, and its seed."""
    from trtserve.eval.grid import load_grid

    try:
        path = Path(grid)
        loaded = load_grid(path=path) if grid.endswith(".toml") or path.is_file() else load_grid(preset=grid)
    except TrtServeError as exc:
        raise TrtServeError(f"--confirm-grid {grid}: {exc}") from None
    return loaded.shapes(), loaded.seed


def _cmd_eval(args: argparse.Namespace) -> int:
    from trtserve.eval.report import write_report

    if args.action:
        if args.action[0] != "report" or len(args.action) != 2:
            raise TrtServeError("use `trtserve eval [--preset NAME | --grid FILE]` or `trtserve eval report DIR`")
        print(f"report written to {write_report(Path(args.action[1]))}")
        return 0
    from trtserve.eval.grid import load_grid
    from trtserve.eval.runner import run_grid

    grid = load_grid(args.grid, args.preset if args.preset or args.grid else "quick")
    out = args.out or Path(f"eval-{grid.name}")
    try:
        run_grid(grid, out, resume=args.resume)
    except KeyboardInterrupt:
        print(f"interrupted: every configuration measured so far is in {out / 'results.jsonl'}; "
              f"rerun with --resume to continue", file=sys.stderr)
        return 130
    print(f"results in {out}; report written to {write_report(out)}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from trtserve.doctor import render, report

    facts = report()
    print(json.dumps(facts, indent=2) if args.json else render(facts))
    return 0


def _trt_options(args: argparse.Namespace):
    from trtserve.engine_builder.tensorrt import TrtOptions

    if args.workspace_mib is not None and args.workspace_mib < 1:
        raise TrtServeError(f"--workspace-mib must be at least 1, got {args.workspace_mib}")
    return TrtOptions(workspace_mib=args.workspace_mib, timing_cache=args.timing_cache,
                      version_compatible=args.version_compatible,
                      hardware_compatibility=args.hardware_compatibility,
                      compute_capabilities=tuple(args.compute_capability))


def _cmd_info(args: argparse.Namespace) -> int:
    from trtserve.engine_builder.info import describe_manifest
    from trtserve.engine_dir import open_engine_dir

    engine = open_engine_dir(args.engine_dir, verify=not args.no_verify)
    print(json.dumps(engine.manifest.to_json(), indent=2) if args.json else describe_manifest(engine))
    return 0


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from trtserve.engine_builder.build import remeasure
    from trtserve.engine_dir import open_engine_dir
    from trtserve.precision.run import summary

    if args.text is not None and not args.text.is_file():
        raise TrtServeError(f"--text {args.text} is not a readable file: give a UTF-8 text file")
    engine = open_engine_dir(args.engine_dir)
    report = remeasure(engine, args.text)
    if args.json:
        print(json.dumps(report, indent=2))
    assert engine.manifest.precision is not None  # measured again: a checkpoint engine's
    print(f"fidelity of {engine.path} ({engine.manifest.precision.policy}) vs torch fp32: {summary(report)}")
    for failure in report["failures"]:
        print(f"  miss: {failure}")
    return 0 if report["passed"] else 1


def _cmd_probe(args: argparse.Namespace) -> int:
    import onnx

    from trtserve.engine_builder.build import fp32_export
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.models.sources import resolve
    from trtserve.precision.measure import Corpus
    from trtserve.precision.policy import get_policy
    from trtserve.precision.probe import real_vs_random
    from trtserve.precision.probe_report import to_markdown
    from trtserve.progress import step

    source = resolve(args.model)
    model = onnx.load(str(fp32_export(source)))
    with step(f"probing {source.model_id}: real text vs random ids under {args.policy}"):
        report = real_vs_random(source, model, get_policy(args.policy), load_hf_tokenizer(source.path),
                                Corpus.wikipedia(), length=args.length, batches=args.batches)
    command = f"trtserve probe {args.model} --policy {args.policy} --length {args.length} --batches {args.batches}"
    text = to_markdown(source.model_id, report, command)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
        args.report.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from trtserve.engine_dir.kinds import ModelKind
    from trtserve.runtime import load_backend
    from trtserve.runtime.text import TextEngine

    backend = load_backend(args.engine_dir, args.backend)
    engine = TextEngine(backend)
    texts = args.text or [_default_text(backend.engine.kind)]
    if backend.engine.kind == ModelKind.DECODER:
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
    from trtserve.precision.run import summary

    print(f"fidelity vs torch fp32 at build ({backend.engine.manifest.precision.policy}): "
          f"{summary(backend.engine.manifest.fidelity)}")
    backend.close()
    return 0


def _default_text(kind: ModelKind) -> str:
    from trtserve.data.corpus import wiki_paragraphs
    from trtserve.engine_dir.kinds import ModelKind

    first = wiki_paragraphs()[0]
    return " ".join(first.split()[:40]) if kind == ModelKind.DECODER else first


def _serve_parser(sub) -> None:
    from trtserve.deploy.options import RayOptions, ServeTarget
    from trtserve.server.config import ServerConfig
    from trtserve.settings import add_flags

    serve = sub.add_parser("serve", help="serve engines over HTTP (OpenAI-compatible and KServe v2); every flag is "
                           "also read from a TRTSERVE_* variable, e.g. TRTSERVE_PORT")
    serve.add_argument("model", nargs="*", default=argparse.SUPPRESS, metavar="[NAME=]MODEL",
                       help=(ServeTarget.model_fields["model"].description or "") + "; several are served side by "
                       "side, each under its manifest's model id or the NAME given")
    add_flags(serve, ServerConfig, skip=("engine_dir",))
    add_flags(serve, ServeTarget, skip=("model",))
    ray = serve.add_argument_group("Ray Serve (a cluster of replicas instead of local worker processes)")
    add_flags(ray, RayOptions)
    serve.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from trtserve.deploy.options import RayOptions, ServeTarget
    from trtserve.server.config import ServerConfig, check_tls
    from trtserve.settings import load

    models = vars(args).pop("model", None) or []  # positional: a list; TRTSERVE_MODEL: one
    target = load(ServeTarget, args)
    models = models or ([target.model] if target.model else [])
    if not models and not target.model_repository:
        raise TrtServeError("give an engine directory or a model to serve (or set TRTSERVE_MODEL), or "
                            "--model-repository")
    cfg = load(ServerConfig, args, engine_dir=models[0] if models else target.model_repository)
    check_tls(cfg)  # before an engine is built at first start
    ray = load(RayOptions, args)
    if ray.ray:  # every replica holds all the engines
        from trtserve.deploy.ray_serve import run

        run(models, target.precision, target.backend, cfg, ray, repository=target.model_repository)
        return 0
    from trtserve.deploy.engines import served_engines
    from trtserve.server.app import serve
    from trtserve.server.registry import plan

    served = served_engines(models, target.model_repository, target.precision, target.backend)
    engines = [(name, str(path)) for name, path in served]
    configs = plan(cfg, engines)  # a clash of names or a wrong --tracks: one clear error before the server starts
    from trtserve.engine_dir import open_engine_dir
    from trtserve.server.generation import check_tracks_option

    for c in configs.values():
        check_tracks_option(c.engine_dir, open_engine_dir(c.engine_dir, verify=False).manifest, cfg.tracks, cfg.workers)
    serve(cfg.model_copy(update={"engine_dir": engines[0][1]}), engines)
    return 0


def _cmd_train_pt(args: argparse.Namespace) -> int:
    from trtserve.research.pt_train import RECIPES, checkpoint, results

    recipe = RECIPES[args.recipe]
    print(f"recipe {recipe.name}: {recipe.layers} layers, hidden {recipe.hidden}, {recipe.heads} heads, "
          f"{recipe.kv_heads} KV heads, FFN {recipe.ffn}, vocabulary {recipe.vocab}; PT: {recipe.n_tracks} tracks, "
          f"D = {recipe.block_depth}; {recipe.steps} steps of {recipe.batch} x {recipe.seq} tokens")
    for kind in ("pt", "dense"):
        path = checkpoint(args.recipe, kind)
        r = results(path)
        print(f"{kind:>5}: held-out perplexity {r['heldout_perplexity']:.2f} over {r['heldout_tokens']} tokens, "
              f"{r['parameters']:,} parameters, trained in {r['train_seconds']:.0f} s, final train loss "
              f"{r['final_train_loss']:.3f} ({path})")
    return 0


def _cmd_healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when the server answers /health with 200 (the container's HEALTHCHECK)."""
    import urllib.error
    import urllib.request

    from trtserve.server.config import ServerConfig
    from trtserve.settings import load, only

    context = None
    try:  # where the server was started: its TRTSERVE_HOST, TRTSERVE_PORT and TLS variables
        started = load(only(ServerConfig, "host", "port", "ssl_certfile"))
    except TrtServeError as exc:
        raise TrtServeError(f"{exc}, or give --url") from None
    host = "127.0.0.1" if started.host in ("0.0.0.0", "") else "::1" if started.host == "::" else started.host
    host = f"[{host}]" if ":" in host else host
    url = args.url or f"{'https' if started.ssl_certfile else 'http'}://{host}:{started.port}/health"
    if url.startswith("https:"):
        import ssl

        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # a probe of its own server, by address
    try:
        with urllib.request.urlopen(url, timeout=args.timeout, context=context) as response:
            print(f"healthy: {url} answered {response.status}")
            return 0
    except urllib.error.HTTPError as exc:
        print(f"unhealthy: {url} answered {exc.code}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url} did not answer ({getattr(exc, 'reason', exc)})", file=sys.stderr)
    return 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtserve", description="Build and serve Transformer inference engines.")
    parser.add_argument("--version", action="version", version=f"trtserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _build_parser(sub.add_parser("build-engine", help="export a checkpoint and build an engine directory"))
    info = sub.add_parser("info", help="print an engine directory's manifest in human form")
    info.add_argument("engine_dir", type=Path)
    info.add_argument("--json", action="store_true", help="print the raw manifest")
    info.add_argument("--no-verify", action="store_true", help="skip checking file sizes and hashes")
    info.set_defaults(func=_cmd_info)
    fid = sub.add_parser("fidelity", help="measure an engine against torch fp32 again, on any text")
    fid.add_argument("engine_dir", type=Path)
    fid.add_argument("--text", type=Path, default=None, help="UTF-8 text file (default: bundled Wikipedia sample)")
    fid.add_argument("--json", action="store_true", help="also print the full report as JSON")
    fid.set_defaults(func=_cmd_fidelity)
    probe = sub.add_parser("probe", help="fp16 overflow probe: real text vs random token ids")
    probe.add_argument("model", help="checkpoint directory or bundled model name")
    probe.add_argument("--policy", default="fp16", choices=["fp16", "hybrid"], help="policy to probe (default fp16)")
    probe.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    probe.add_argument("--batches", type=int, default=4, help="batches of 2 sequences per input kind (default 4)")
    probe.add_argument("--report", type=Path, default=None, help="also write the report here (.md, plus .json)")
    probe.set_defaults(func=_cmd_probe)
    _serve_parser(sub)
    evaluate = sub.add_parser("eval", help="evaluate speed, memory and fidelity over a grid of configurations; "
                              "`trtserve eval report DIR` rebuilds the report from DIR's results")
    evaluate.add_argument("action", nargs="*", help="nothing to run a grid, or: report DIR")
    evaluate.add_argument("--grid", type=Path, default=None, help="grid file (TOML)")
    evaluate.add_argument("--preset", default=None, help="quick (CI, minutes), paper (>= 480 configurations), "
                          "long (decoder at 1024 and 2048 tokens), full")
    evaluate.add_argument("--out", type=Path, default=None, help="results directory (default eval-<grid name>)")
    evaluate.add_argument("--resume", action="store_true", help="continue DIR/results.jsonl, skipping what is done")
    evaluate.set_defaults(func=_cmd_eval)
    train = sub.add_parser("train-pt", help="train a parallel-track model and a dense one of the same size on "
                           "Wikipedia (cached by recipe) and compare held-out perplexity")
    train.add_argument("--recipe", default="small", choices=["small", "tiny"])
    train.set_defaults(func=_cmd_train_pt)
    health = sub.add_parser("healthcheck", help="exit 0 if a server answers /health (for container health checks)")
    health.add_argument("--url", default=None, help="default: /health where `serve` listens with the same "
                        "TRTSERVE_HOST, TRTSERVE_PORT and TRTSERVE_SSL_CERTFILE (http://127.0.0.1:8000/health)")
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(func=_cmd_healthcheck)
    doctor = sub.add_parser("doctor", help="list every backend, its version, and whether it can build or run here")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=_cmd_doctor)
    run = sub.add_parser("run", help="run an engine on text: embeddings for encoders, greedy text for decoders")
    run.add_argument("engine_dir", type=Path)
    run.add_argument("--text", action="append", help="input text (repeat for several); default: a Wikipedia paragraph")
    run.add_argument("--max-new-tokens", type=int, default=32, help="decoders: tokens to generate (default 32)")
    run.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "openvino", "torch"],
                     help="runtime backend (openvino: an engine whose build measured it; torch: the fp32 reference)")
    run.set_defaults(func=_cmd_run)
    return parser


# the extra (pyproject.toml) that installs each optional module a command may need
EXTRAS = {"torch": "export", "transformers": "export", "safetensors": "export", "onnxscript": "export",
          "gguf": "export", "accelerate": "export", "fastapi": "serve", "uvicorn": "serve",
          "prometheus_client": "serve", "jinja2": "serve", "llguidance": "serve", "ray": "ray",
          "matplotlib": "eval", "tensorrt_rtx": "tensorrt-rtx"}


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
    except BrokenPipeError:  # the reader of stdout went away (`trtserve info DIR | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the flush at exit is quiet
        return 0
    except Exception as exc:
        # Ctrl-C inside a native import surfaces as e.g. ImportError raised from KeyboardInterrupt.
        if _caused_by_interrupt(exc):
            print("interrupted: nothing was written", file=sys.stderr)
            return 130
        extra = EXTRAS.get((exc.name or "").split(".")[0]) if isinstance(exc, ModuleNotFoundError) else None
        if extra is not None:  # an optional dependency this command needs is not installed
            assert isinstance(exc, ModuleNotFoundError)
            print(f"error: `trtserve {args.command}` needs {exc.name}, which is not installed: "
                  f"pip install 'trtserve[{extra}]'", file=sys.stderr)
            return 2
        if os.environ.get("TRTSERVE_DEBUG"):
            raise
        print(f"error: unexpected {type(exc).__name__}: {exc}\n"
              "this is a bug in trtserve; rerun with TRTSERVE_DEBUG=1 for the traceback and report it",
              file=sys.stderr)
        return 1


def _caused_by_interrupt(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    return _run(make_parser(), argv)


def build_engine_main(argv: list[str] | None = None) -> int:
    """The `build-engine` console script: the same command as `trtserve build-engine`."""
    return _run(_build_parser(argparse.ArgumentParser(prog="build-engine")), argv)


if __name__ == "__main__":
    sys.exit(main())
