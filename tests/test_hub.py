"""Hub repo ids: a Hugging Face cache folder in the hub's own layout, loaded offline (no network in CI);
what an online download asks for (huggingface_hub stubbed); the errors; one download per machine."""

import json
import os
import threading
import time

import httpx
import pytest
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from pagoda import LLM, SamplingParams
from pagoda.cli.main import build_parser, main
from pagoda.errors import ConfigError, ModelLoadError
from pagoda.loader import hub, hub_wait
from pagoda.loader.source import default_model_path, resolve_source
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda.testing.hub_cache import add_directory_to_hub_cache, add_to_hub_cache

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two revisions of one tiny Llama (different weights) and a cache holding both: main and tag v2."""
    root = tmp_path_factory.mktemp("hub")
    first = make_tiny_checkpoint("llama", root / "first", seed=1, tokenizer=True, **TINY)
    second = make_tiny_checkpoint("llama", root / "second", seed=2, tokenizer=True, **TINY)
    cache = root / "cache"
    add_directory_to_hub_cache(cache, "tiny-org/tiny-llama", first)
    add_directory_to_hub_cache(cache, "tiny-org/tiny-llama", second, revision="v2")
    return first, second, cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_repo_id_loads_from_the_cache_offline_like_its_directory(checkpoints, offline):
    first, second, cache = checkpoints
    prompts = random_prompts(3, 320, 4, 20, seed=2)
    by_repo = LLM(model="tiny-org/tiny-llama", download_dir=str(cache), **ENGINE)
    assert by_repo.engine.model_name == "tiny-org/tiny-llama"  # the API reports the repo id, as vLLM does
    assert by_repo.engine.source.repo_id == "tiny-org/tiny-llama"
    assert by_repo.engine.source.path.parent.name == "snapshots"
    assert by_repo.engine.tokenizer is not None  # the snapshot's tokenizer
    assert _tokens(by_repo, prompts) == _tokens(LLM(model=str(first), **ENGINE), prompts)
    tagged = LLM(model="tiny-org/tiny-llama", revision="v2", download_dir=str(cache), **ENGINE)
    assert _tokens(tagged, prompts) == _tokens(LLM(model=str(second), **ENGINE), prompts)
    assert _tokens(tagged, prompts) != _tokens(by_repo, prompts)


def test_cli_loads_a_repo_id_and_a_tokenizer_repo(checkpoints, offline, capsys, tmp_path):
    first, _, cache = checkpoints
    code = main(["generate", "--model", "tiny-org/tiny-llama", "--download-dir", str(cache), "--device", "cpu",
                 "--dtype", "float32", "--num-kv-blocks", "32", "--prompt", "hello", "--max-tokens", "4", "--json"])
    assert code == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out.strip().splitlines()[-1])["outputs"][0]["token_ids"]) == 4
    assert "[tiny-org/tiny-llama on cpu/float32" in err
    # a tokenizer from a repo id of its own (only its tokenizer files are cached)
    tok_files = {f: first / f for f in ("tokenizer.json", "tokenizer_config.json")}
    add_to_hub_cache(cache, "tiny-org/tokenizer-only", tok_files)
    llm = LLM(model=str(first), tokenizer="tiny-org/tokenizer-only", download_dir=str(cache), **ENGINE)
    assert llm.engine.tokenizer.encode("hi") == LLM(model=str(first), **ENGINE).engine.tokenizer.encode("hi")


def test_serve_takes_the_model_as_its_argument():
    from pagoda.cli.serve import serve_engine_config

    args = build_parser().parse_args(["serve", "Qwen/Qwen3-8B", "--revision", "v1"])
    config = serve_engine_config(args)
    assert (config.model, config.revision) == ("Qwen/Qwen3-8B", "v1")
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-8B", "--model", "other/model"])
    with pytest.raises(ConfigError, match="two models"):
        serve_engine_config(args)


def test_offline_and_not_cached_names_the_repo_and_the_cache(checkpoints, offline, tmp_path):
    _, _, cache = checkpoints
    with pytest.raises(ModelLoadError) as err:
        LLM(model="tiny-org/absent", download_dir=str(tmp_path), **ENGINE)
    assert "tiny-org/absent is not in the local Hugging Face cache" in str(err.value)
    assert str(tmp_path) in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)
    with pytest.raises(ModelLoadError, match="revision nope.*not in the local"):
        resolve_source("tiny-org/tiny-llama", revision="nope", download_dir=str(cache))


def test_cached_repo_without_weights_says_what_is_missing(tmp_path, offline, checkpoints):
    first, _, _ = checkpoints
    add_to_hub_cache(tmp_path, "tiny-org/pickles", {"config.json": first / "config.json",
                                                     "pytorch_model.bin": b"not loaded"})
    with pytest.raises(ModelLoadError, match="tiny-org/pickles has only PyTorch pickle weights"):
        resolve_source("tiny-org/pickles", download_dir=str(tmp_path))


def test_gguf_by_file_name_or_quantization_tag(tmp_path, offline):
    gguf = default_model_path()  # the embedded SmolLM2 Q4_1 GGUF, linked into a fake repo
    add_to_hub_cache(tmp_path, "tiny-org/smol-GGUF", {"smol.Q4_1.gguf": gguf, "smol.Q8_0.gguf": b"GGUF",
                                                      "README.md": b"hi"}, link=True)
    for spec in ("tiny-org/smol-GGUF:smol.Q4_1.gguf", "tiny-org/smol-GGUF:Q4_1", "tiny-org/smol-GGUF:q4_1"):
        source = resolve_source(spec, download_dir=str(tmp_path))
        assert source.kind == "gguf" and source.path.name == "smol.Q4_1.gguf" and source.repo_id == "tiny-org/smol-GGUF"
        assert source.path.resolve() == gguf.resolve()
    with pytest.raises(ModelLoadError, match="no GGUF file matches the quantization tag 'Q5_K_M'.*smol.Q4_1.gguf"):
        resolve_source("tiny-org/smol-GGUF:Q5_K_M", download_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="no config.json.*tiny-org/smol-GGUF:FILE.gguf"):
        resolve_source("tiny-org/smol-GGUF", download_dir=str(tmp_path))


def test_what_is_and_is_not_a_repo_id():
    assert hub.parse_hub_reference("Qwen/Qwen3-8B") == hub.HubReference("Qwen/Qwen3-8B")
    assert hub.parse_hub_reference("org/name:Q4_K_M") == hub.HubReference("org/name", "Q4_K_M")
    for not_repo in ("./org/name", "/abs/path", "~/x/y", "just-a-name", "a/b/c", "org/name:a:b", "org/../x"):
        assert hub.parse_hub_reference(not_repo) is None, not_repo
    with pytest.raises(ModelLoadError, match="does not exist.*repo id ORG/NAME"):
        resolve_source("just-a-name")


def test_files_chosen_from_a_repo_listing():
    ref = hub.HubReference("org/m")
    listing = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
               "model.safetensors", "consolidated.safetensors", "pytorch_model.bin", "original/params.json",
               "original/consolidated.00.pth", "onnx/model.onnx"]
    assert hub.choose_files(ref, listing, "org/m") == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    sharded = ["config.json", hub.INDEX, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert hub.choose_files(ref, sharded, "org/m", fetch_index=lambda: index) == sharded
    assert hub.choose_files(ref, listing, "org/m", tokenizer_only=True) == ["config.json", "tokenizer.json",
                                                                          "tokenizer_config.json"]
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        hub.choose_files(ref, ["config.json", "README.md"], "org/m")
    with pytest.raises(ModelLoadError, match="several GGUF files match 'Q4'"):
        hub.pick_gguf(hub.HubReference("org/m", "Q4"), ["m.Q4.gguf", "m-Q4.gguf"], "org/m:Q4")
    split = ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    assert hub.pick_gguf(hub.HubReference("org/m", "Q8_0"), split, "org/m") == split[0]


def test_online_download_asks_for_safetensors_only(monkeypatch, tmp_path, checkpoints):
    """With the Hub reachable (stubbed here: CI has no network) the listing decides, and
    snapshot_download is asked for exactly the config, tokenizer and safetensors files."""
    first, _, _ = checkpoints
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    listing = sorted(p.name for p in first.iterdir()) + ["pytorch_model.bin", "model.onnx", "original/x.pth"]
    calls = {}
    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", lambda self, repo_id, revision=None: listing)

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        calls.update(repo_id=repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns)
        return str(first)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    source = resolve_source("tiny-org/online", revision="abc", download_dir=str(tmp_path))
    assert source.path == first and source.kind == "hf"
    assert calls["repo_id"] == "tiny-org/online" and calls["revision"] == "abc" and calls["cache_dir"] == str(tmp_path)
    assert "model.safetensors" in calls["allow_patterns"] and "config.json" in calls["allow_patterns"]
    assert not [p for p in calls["allow_patterns"] if p.endswith((".bin", ".pth", ".onnx"))]


def _http_error(cls, status: int, message: str):
    request = httpx.Request("GET", "https://huggingface.co/api/models/x")
    return cls(message, response=httpx.Response(status, request=request))


@pytest.mark.parametrize("error, expected", [
    (lambda: _http_error(RepositoryNotFoundError, 404, "nope"), "no local folder of that name exists and the "
                                                                "Hugging Face Hub has no such repo, or it is private"),
    (lambda: _http_error(GatedRepoError, 403, "gated"), "is gated: accept its terms.*HF_TOKEN"),
    (lambda: _http_error(RevisionNotFoundError, 404, "rev"), "no such revision"),
])
def test_hub_errors_name_the_repo_and_the_remedy(monkeypatch, error, expected):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def fail(self, repo_id, revision=None):
        raise error()

    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", fail)
    with pytest.raises(ModelLoadError, match=f"tiny-org/private.*{expected}"):
        resolve_source("tiny-org/private")


def test_unreachable_hub_falls_back_to_the_cache(monkeypatch, checkpoints):
    _, _, cache = checkpoints
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def down(self, repo_id, revision=None):
        raise httpx.ConnectError("no route to host")

    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", down)
    source = resolve_source("tiny-org/tiny-llama", download_dir=str(cache))
    assert (source.path / "config.json").is_file()


def test_torchrun_local_rank_zero_downloads_and_the_others_wait(monkeypatch, tmp_path):
    monkeypatch.setattr(hub_wait.tempfile, "gettempdir", lambda: str(tmp_path))
    env = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(path=hub_wait.once_per_machine(
        "org/x@None", lambda: pytest.fail("a rank other than local rank 0 downloaded"))))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # waiting for rank 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert hub_wait.once_per_machine("org/x@None", lambda: tmp_path / "snap") == tmp_path / "snap"
    waiter.join(timeout=10)
    assert got["path"] == tmp_path / "snap"
    # rank 0's error reaches the others
    def fail():
        raise ModelLoadError("org/y is gated")
    with pytest.raises(ModelLoadError, match="gated"):
        hub_wait.once_per_machine("org/y@None", fail)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ModelLoadError, match="local rank 0 failed to fetch org/y: org/y is gated"):
        hub_wait.once_per_machine("org/y@None", lambda: None)
    # a marker of an earlier job is not taken for this one
    marker = hub_wait.marker_path("org/z@None")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"path": "/old"}))
    old = time.time() - 2 * hub_wait.START_SKEW_S
    os.utime(marker, (old, old))
    with pytest.raises(ModelLoadError, match="waited 0 s"):
        hub_wait.wait_for(marker, "org/z@None", time.time(), timeout=0.5)


@pytest.mark.timeout(300)
def test_tensor_parallel_workers_read_rank_zeros_copy(checkpoints, offline, monkeypatch):
    """pagoda's own workers never resolve the repo id: rank 0 hands them the snapshot folder."""
    first, _, cache = checkpoints
    prompts = random_prompts(2, 320, 4, 12, seed=5)
    llm = LLM(model="tiny-org/tiny-llama", download_dir=str(cache), tensor_parallel_size=2, **ENGINE)
    try:
        assert _tokens(llm, prompts) == _tokens(LLM(model=str(first), **ENGINE), prompts)
    finally:
        llm.shutdown()


def test_cache_layout_helper_matches_huggingface_hub(tmp_path):
    from huggingface_hub import scan_cache_dir

    add_to_hub_cache(tmp_path, "a/b", {"config.json": b"{}", "sub/w.safetensors": b"x"}, commit="c" * 40)
    info = scan_cache_dir(tmp_path)
    (repo,) = info.repos
    assert repo.repo_id == "a/b" and {f.file_name for r in repo.revisions for f in r.files} == {"config.json",
                                                                                              "w.safetensors"}
    assert (tmp_path / "models--a--b" / "refs" / "main").read_text() == "c" * 40


def test_server_serves_a_repo_id_under_its_name(checkpoints, offline):
    import openai
    from pagoda.config import EngineConfig
    from pagoda.server import ServerConfig, ServerThread, build_app

    _, _, cache = checkpoints
    engine = EngineConfig(model="tiny-org/tiny-llama", download_dir=str(cache), **ENGINE)
    with ServerThread(build_app(engine, ServerConfig())) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny-org/tiny-llama"]
        out = client.completions.create(model="tiny-org/tiny-llama", prompt="hi", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
