"""Serving side by side under guidellm, a load generator made for OpenAI-compatible servers: trtserve (one
server per engine) and llama.cpp's own `llama-server` on the GGUF file SmolLM2 ships as, all started
together with the same threads, then each driven in turn by the same guidellm run (chat route, streamed,
synthetic prompts of exactly N tokens, exactly M output tokens with ignore_eos, concurrent streams sent
back to back); the order of the servers is reversed for every other shape.

    .venv/bin/python -m benchmarks.serving.bench_serving --engine fp32=engines/smollm2 [--engine int4=DIR ...]
        [--llama-server [BINARY]] [--concurrency 1 8 32] [--shape 128/64 512/128] [--seconds 60]
        [--threads 2] [--max-num-seqs 32] [--server-args NAME="--max-prefill-tokens 256"] [--out DIR]

The peers are not dependencies: guidellm comes from benchmarks/peers/setup_guidellm.sh (a venv of its own) and
llama-server from benchmarks/peers/setup_llama_server.sh. guidellm's figures, as it defines them: output tok/s over
the window; TTFT percentiles over requests; ITL percentiles over each request's mean gap between tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from trtserve.testing.server import free_port, launch, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def peers() -> Path:
    from trtserve.fileio import cache_root

    return cache_root() / "peers"


def start_llama_server(binary: Path, gguf: Path, threads: int, slots: int, context: int):
    """llama-server on a free port, `slots` sequences of `context` tokens each, the plain CPU path (no
    repacked weights: their AMX path crashes on some VMs); (process, url) once /health answers."""
    port = free_port()
    return launch([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * context),
                   "--no-repack", "-ngl", "0", "--alias", MODEL], port, name="llama-server")


def guidellm(binary: Path, url: str, tokenizer: Path, prompt: int, output: int, streams: list[int], seconds: float,
             out: Path) -> list[dict]:
    """One guidellm run over `streams` concurrencies against `url`; a row per concurrency."""
    levels = ",".join(f"streams[{i}]={n}" for i, n in enumerate(streams))
    subprocess.run([str(binary), "run",
                    "--backend", f"kind=openai_http,target={url},model={MODEL},"
                                 "request_format=/v1/chat/completions,stream=true",
                    "--profile", f"kind=concurrent,{levels},warmup=5",
                    "--constraint", f"kind=max_duration,seconds={seconds + 5:g}",
                    "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                    "--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}",
                    "--output", f"kind=json,path={out}", "--disable-console"],
                   check=True, env={**os.environ, **OFFLINE}, timeout=len(streams) * (seconds + 120))
    return [_row(b) for b in json.loads(out.read_text())["benchmarks"]]


def _row(benchmark: dict) -> dict:
    m, ok = benchmark["metrics"], "successful"
    return {"streams": benchmark["config"]["strategy"]["streams"],
            "output_tok_s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft_p50_ms": m["time_to_first_token_ms"][ok]["percentiles"]["p50"],
            "ttft_p99_ms": m["time_to_first_token_ms"][ok]["percentiles"]["p99"],
            "itl_p50_ms": m["inter_token_latency_ms"][ok]["percentiles"]["p50"],
            "itl_p99_ms": m["inter_token_latency_ms"][ok]["percentiles"]["p99"],
            **{k: m["request_totals"][k] for k in ("successful", "errored", "incomplete")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=DIR", help="a trtserve engine to serve")
    parser.add_argument("--llama-server", nargs="?", const="", default=None, metavar="BINARY",
                        help="also llama-server (default: the one benchmarks/peers/setup_llama_server.sh built)")
    parser.add_argument("--gguf", type=Path, help="llama-server's model (default: the GGUF file SmolLM2 ships as)")
    parser.add_argument("--guidellm", type=Path, default=None, help="default: benchmarks/peers/setup_guidellm.sh's")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--shape", nargs="+", default=["128/64", "512/128"], help="prompt/output tokens")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="each concurrency's run; its first 5 s are a warm-up, not counted")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="trtserve's; llama-server gets as many slots")
    parser.add_argument("--server-args", action="append", default=[], metavar="NAME=ARGS",
                        help="more `trtserve serve` flags for the engine NAME (one string; the same engine directory "
                             "may be given twice under two names to compare flags)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-serving-")))
    args = parser.parse_args()

    from trtserve.models.sources import resolve

    source = resolve(MODEL)
    binary = args.guidellm or peers() / "guidellm-venv" / "bin" / "guidellm"
    shapes = [tuple(int(x) for x in s.split("/")) for s in args.shape]
    extra = {name: shlex.split(flags) for name, _, flags in (a.partition("=") for a in args.server_args)}
    names = [spec.partition("=")[0] for spec in args.engine]
    if set(extra) - set(names):
        parser.error(f"--server-args for an engine not given: {', '.join(sorted(set(extra) - set(names)))}")
    servers, procs = {}, []
    try:
        for spec in args.engine:
            name, _, engine = spec.partition("=")
            proc, url = start_server(engine, "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
                                     "--max-queue", "1024", "--request-timeout", "600", *extra.get(name, []))
            procs.append((proc, stop_server))
            servers[f"trtserve {name}"] = url
        if args.llama_server is not None:
            gguf = args.gguf or source.gguf
            llama = Path(args.llama_server or peers() / "llama-server" / "bin" / "llama-server")
            context = max(p + o for p, o in shapes) + 64  # the chat template's tokens too
            proc, url = start_llama_server(llama, gguf, args.threads, args.max_num_seqs, context)
            procs.append((proc, lambda p: (p.terminate(), p.wait(30))))
            servers["llama-server"] = url
        args.out.mkdir(parents=True, exist_ok=True)
        results = []
        for i, (prompt, output) in enumerate(shapes):
            order = list(servers.items())[:: -1 if i % 2 else 1]
            for name, url in order:
                out = args.out / f"{name.replace(' ', '-')}-{prompt}-{output}.json"
                for row in guidellm(binary, url, source.path, prompt, output, args.concurrency, args.seconds, out):
                    results.append({"server": name, "shape": f"{prompt}/{output}", **row})
    finally:
        for proc, stop in procs:
            stop(proc)
    print(f"{MODEL}, guidellm {args.seconds:.0f} s per concurrency, chat route, {args.threads} threads per server, "
          f"{args.max_num_seqs} sequences at once; JSON in {args.out}")
    print("| prompt/output | concurrency | server | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
          "| ok / errored / incomplete |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["shape"], r["streams"], r["server"])):
        print(f"| {r['shape']} | {r['streams']} | {r['server']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} ms "
              f"| {r['ttft_p99_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms | {r['itl_p99_ms']:.1f} ms "
              f"| {r['successful']} / {r['errored']} / {r['incomplete']} |")


if __name__ == "__main__":
    main()
