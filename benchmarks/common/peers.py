"""The CPU peers run in process: llama.cpp (llama-cpp-python, benchmarks/peers/setup_llama_cpp.sh) and ONNX Runtime
GenAI (benchmarks/peers/setup_ort_genai.sh). Neither is a dependency: each is imported when used."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, n_ctx: int = 1024, logits_all: bool = False):
        from llama_cpp import Llama

        # the AMX buffer types crash on some VMs; the plain CPU path is what a default build runs elsewhere
        self.llm = Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False, use_extra_bufts=False,
                         logits_all=logits_all)

    def logits(self, ids: list[int]) -> np.ndarray:
        """(S, V) next-token logits of every position (needs `logits_all`)."""
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[:len(ids)], np.float32)

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        self.llm.reset()
        out, first = [], None
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            first = first or time.perf_counter()
            if len(out) == tokens:
                break
        return time.perf_counter() - first, out


class OrtGenAI:
    """ONNX Runtime GenAI on a model its builder wrote (benchmarks/peers/setup_ort_genai.sh): its own decode loop,
    KV buffer shared by past and present, greedy search."""

    def __init__(self, model_dir: Path, threads: int):
        import json

        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def run(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + tokens, min_length=len(prompt) + tokens, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(prompt)  # the prompt's forward pass
        out, first = [], None
        while len(out) < tokens and not generator.is_done():
            generator.generate_next_token()  # the first picks from the prompt's logits, later ones run a step
            out.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter()
        return time.perf_counter() - first, out

    def run_many(self, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        """The prompts (all of one length) as one batch of its greedy search."""
        started = time.perf_counter()
        params = self.og.GeneratorParams(self.model)
        length = len(prompts[0]) + tokens
        params.set_search_options(batch_size=len(prompts), max_length=length, min_length=length, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array(prompts, np.int32))
        out = [[] for _ in prompts]
        while len(out[0]) < tokens and not generator.is_done():
            generator.generate_next_token()
            for row, token in enumerate(np.asarray(generator.get_next_tokens()).ravel()):
                out[row].append(int(token))
        return time.perf_counter() - started, out

    def logits(self, ids: list[int]) -> np.ndarray:
        """(S, V) next-token logits of every position of one prompt pass."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + 1)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(ids)
        return np.asarray(generator.get_output("logits"))[0]
