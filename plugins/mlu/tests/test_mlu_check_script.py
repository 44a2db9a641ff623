"""The hardware check script, run on the CPU as CI can (on an MLU it is the first thing to run)."""

import json

from mlu_stand_ins import install_torch_mlu
from pagoda_mlu.check import main


def test_check_script_on_cpu(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert main(["--device", "cpu", "--json", str(out)]) == 0
    statuses = {r["name"]: r["status"] for r in json.loads(out.read_text())}
    assert statuses == {
        "torch_mlu and devices": "SKIP", "mlu_chunked attention": "PASS", "mlu_fused attention": "SKIP",
        "torch_mlu_ops kernels": "SKIP", "KV pool": "PASS", "tiny Llama, mlu_chunked": "PASS",
        "tiny Llama, mlu_fused": "SKIP"}
    assert "all checks passed or were skipped" in capsys.readouterr().out


def test_check_script_without_torch_mlu_fails_first_and_says_why(monkeypatch, capsys):
    install_torch_mlu(monkeypatch, None, import_error=ImportError("No module named 'torch_mlu'"))
    assert main([]) == 1
    text = capsys.readouterr().out
    assert "FAIL  torch_mlu and devices        torch_mlu is not importable" in text
    assert "1 failed: torch_mlu and devices" in text
