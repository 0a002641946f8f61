"""Serve an engine directory on a free port, ask it one question with the official openai client,
stream the answer, and stop the server. Used by scripts/demo.sh."""

import socket
import subprocess
import sys
import time

import httpx
import openai

engine = sys.argv[1]
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
server = subprocess.Popen([sys.executable, "-m", "trtserve", "serve", engine, "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.time() > deadline:
            sys.exit(f"the server did not start; run `trtserve serve {engine}` to see why")
        time.sleep(0.3)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    question = "What is the capital of France?"
    print(f"served {model} on port {port}; chat: {question}")
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                temperature=0, max_tokens=40, stream=True):
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
finally:
    server.terminate()
    server.wait(timeout=30)
