"""Pooling runner (docs/pooling.md): embeddings against transformers' hidden states pooled the same way
(LAST, MEAN, CLS), through chunked prefill, mixed-length batches and the prefix cache; score heads of
*ForSequenceClassification checkpoints and yes/no-token rerankers against transformers."""

import json
import shutil

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError, RequestError
from pagoda.pooling import PoolingParams
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda.testing.reference import save_byte_tokenizer, widen_weights

VOCAB = 320
QWEN3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
# a 40-token step budget and 16-token blocks: prompts of up to 100 tokens prefill over several chunks
ENGINE = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=40,
              max_num_seqs=4, runner="pooling", max_model_len=128)
PROMPTS = random_prompts(5, VOCAB, 3, 100, seed=3)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), seed=2, tokenizer=True, **QWEN3)


@pytest.fixture(scope="module")
def hf_hidden(decoder):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(decoder, dtype=torch.float32).eval()

    @torch.no_grad()
    def hidden(ids: list[int]) -> torch.Tensor:  # [T, H]: after the final norm
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]

    return hidden


def pool(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0))


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers_pooled_the_same_way(decoder, hf_hidden, kind):
    llm = LLM(str(decoder), pooling_type=kind, normalize=False, **ENGINE)
    batch = llm.embed(PROMPTS)
    for prompt, out in zip(PROMPTS, batch):
        want = pool(hf_hidden(prompt), kind)
        got = torch.tensor(out.outputs.embedding)
        assert cosine(got, want) > 0.99999
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # mixed lengths in one batch give what each prompt gives alone
    for prompt, out in zip(PROMPTS, batch):
        alone = llm.embed([prompt])[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(out.outputs.embedding), rtol=1e-5, atol=1e-5)
    stats = llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0  # every prompt's blocks were freed once it was pooled


def test_normalize_dimensions_and_prefix_cache(decoder, hf_hidden):
    llm = LLM(str(decoder), **ENGINE)  # LAST + normalize: the defaults of a decoder without sentence-transformers
    prompt = PROMPTS[1]
    want = pool(hf_hidden(prompt), "LAST")
    first = llm.embed(prompt)[0].outputs.embedding
    assert abs(torch.tensor(first).norm().item() - 1) < 1e-5 and cosine(first, want) > 0.99999
    again = llm.embed([prompt])[0].outputs.embedding  # its full blocks come from the prefix cache
    assert llm.get_stats()["prefix_cache_hit_tokens"] >= 16
    torch.testing.assert_close(torch.tensor(again), torch.tensor(first), rtol=1e-5, atol=1e-5)
    short = llm.embed(prompt, PoolingParams(dimensions=8))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(want[:8], dim=0),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(RequestError, match="dimensions"):
        llm.embed(prompt, PoolingParams(dimensions=65))
    # the context: a longer prompt is refused, or keeps its last tokens when truncate_prompt_tokens asks
    long = random_prompts(1, VOCAB, 130, 130, seed=9)[0]
    with pytest.raises(RequestError, match="130 tokens, over this model's maximum context length of 128") as err:
        llm.embed([long])
    assert err.value.field == "prompt"
    steps = llm.get_stats()["num_steps"]
    cut = llm.embed([long], PoolingParams(truncate_prompt_tokens=100))[0].outputs.embedding
    assert cosine(cut, pool(hf_hidden(long[-100:]), "LAST")) > 0.99999
    assert llm.get_stats()["num_steps"] - steps == 3  # 100 tokens in chunks of at most 40, the state carried
    # generation and embeddings do not mix
    with pytest.raises(RequestError, match="pooling model"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="score head"):
        llm.classify([[5, 6, 7]])
    # an embedding model scores by cosine similarity
    pair = llm.score("hello", ["hello", "good bye"])
    assert pair[0].outputs.score == pytest.approx(1.0, abs=1e-5) and pair[1].outputs.score < 0.9999


def test_sentence_transformers_files_set_the_defaults(decoder, hf_hidden, tmp_path):
    model = tmp_path / "st"
    shutil.copytree(decoder, model)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    llm = LLM(str(model), **ENGINE)
    assert llm.engine.pooling.pooler_config.pooling_type == "MEAN"
    assert llm.engine.pooling.pooler_config.normalize is False  # no Normalize module
    assert not llm.engine.block_manager.enable_prefix_caching  # MEAN reads every position
    got = llm.embed([PROMPTS[0]])[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(got), pool(hf_hidden(PROMPTS[0]), "MEAN"), rtol=1e-4, atol=1e-4)
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling_mode_max_tokens is not supported"):
        LLM(str(model), **ENGINE)
    assert LLM(str(model), pooling_type="cls", **ENGINE).engine.pooling.pooler.name == "CLS"  # a key wins


def make_classifier(directory, num_labels: int, family: str = "qwen3"):
    import transformers

    prefix = {"qwen3": "Qwen3", "llama": "Llama"}[family]
    config = getattr(transformers, f"{prefix}Config")(**QWEN3, num_labels=num_labels, pad_token_id=3)
    torch.manual_seed(5)
    model = getattr(transformers, f"{prefix}ForSequenceClassification")(config).eval()
    widen_weights(model)
    model.save_pretrained(directory, safe_serialization=True)
    save_byte_tokenizer(directory, VOCAB)
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_sequence_classification_scores_and_classes_match_transformers(tmp_path, family):
    from transformers import AutoTokenizer

    reranker = make_classifier(tmp_path / "rerank", 1, family)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rerank")
    llm = LLM(str(tmp_path / "rerank"), **ENGINE)
    query, docs = "what is a pagoda", ["a tiered tower", "a kind of soup with noodles in it", "x"]
    scores = llm.score(query, docs)
    for doc, out in zip(docs, scores):
        ids = tokenizer(query, doc)["input_ids"]
        with torch.no_grad():
            want = torch.sigmoid(reranker(input_ids=torch.tensor([ids])).logits[0, 0]).item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
        assert out.prompt_token_ids == ids
    if family != "qwen3":
        return
    classifier = make_classifier(tmp_path / "classes", 3)
    llm = LLM(str(tmp_path / "classes"), **ENGINE)
    for prompt, out in zip(PROMPTS, llm.classify(PROMPTS)):
        with torch.no_grad():
            want = torch.softmax(classifier(input_ids=torch.tensor([prompt])).logits[0], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, rtol=1e-4, atol=1e-5)


def test_yes_no_token_reranker_matches_transformers(decoder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(decoder)
    no, yes = tokenizer.convert_tokens_to_ids(["n", "y"])
    model = AutoModelForCausalLM.from_pretrained(decoder, dtype=torch.float32).eval()
    llm = LLM(str(decoder), classifier_from_token="n,y", **ENGINE)
    prompts = ["<query>pagoda</query><doc>a tower</doc>", "<query>pagoda</query><doc>soup</doc>"]
    scores = llm.score(prompts[0][:20], [p[20:] for p in prompts])
    for out in scores:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0, -1]
        want = torch.softmax(logits[[no, yes]], dim=-1)[1].item()  # P(yes) over {no, yes}
        assert out.outputs.score == pytest.approx(want, abs=1e-5)


def test_a_generate_engine_refuses_pooling(decoder):
    llm = LLM(str(decoder), **{**ENGINE, "runner": "generate"})
    with pytest.raises(RequestError, match="--runner pooling"):
        llm.engine.add_request(None, [5, 6], PoolingParams())


def test_bench_embed_against_transformers(decoder, tmp_path, capsys):
    from pagoda.cli.main import main

    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--model", str(decoder), "--device", "cpu", "--dtype", "float32",
                 "--num-prompts", "6", "--input-len", "24", "--repeats", "1", "--baseline", "hf",
                 "--hf-batch-size", "3", "--check-prompts", "6", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "pagoda.bench.embed/1" and res["baseline"]["prompts"] == 6
    assert res["check"]["prompts"] == 6 and res["check"]["min_cosine"] > 0.99999
    assert res["pagoda"]["embeddings_per_s"] > 0 and "speedup" in capsys.readouterr().out


def test_cli_embed_and_score(decoder, capsys):
    from pagoda.cli.main import main

    args = ["--model", str(decoder), "--device", "cpu", "--dtype", "float32", "--prompt", "hello", "--prompt", "bye"]
    assert main(["embed", *args, "--dimensions", "4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["hello", "bye"] and all(len(r["embedding"]) == 4 for r in rows)
    assert main(["embed", *args, "--score-against", "hello"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["score"] == pytest.approx(1.0, abs=1e-5) and rows[1]["score"] < 0.9999


def test_bare_decoder_checkpoints_and_the_transformers_fallback(decoder, hf_hidden, tmp_path):
    """A checkpoint saved from the bare decoder (AutoModel: `layers.*`, no LM head, as sentence-transformers'
    Qwen3-Embedding) loads; the transformers fallback pools the same hidden states."""
    from transformers import AutoModel, AutoTokenizer

    AutoModel.from_pretrained(decoder, dtype=torch.float32).save_pretrained(tmp_path / "bare")
    AutoTokenizer.from_pretrained(decoder).save_pretrained(tmp_path / "bare")
    for path, impl in ((tmp_path / "bare", "auto"), (decoder, "transformers")):
        llm = LLM(str(path), model_impl=impl, normalize=False, **ENGINE)
        for prompt, out in zip(PROMPTS[:2], llm.embed(PROMPTS[:2])):
            assert cosine(out.outputs.embedding, pool(hf_hidden(prompt), "LAST")) > 0.99999
