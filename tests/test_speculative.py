"""Speculative decoding (docs/speculative.md): greedy outputs identical to plain decoding and to
transformers for every method, under chunked prefill and preemption; rejection sampling keeps the
target's distribution; stops cut inside drafts; KV blocks of rejected drafts are given back."""

import argparse

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.engine.block_manager import chain_hash
from pagoda.errors import ConfigError
from pagoda.speculative.acceptance import accept_sampled
from pagoda.testing import check_greedy, hf_greedy_tokens, make_tiny_checkpoint, random_prompts

VOCAB = 260
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
BLOCK = 8
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("target"), seed=3, tokenizer=True, **TINY)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):  # another model, same vocabulary: low acceptance, exactness still required
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("draft"), seed=11,
                                **{**TINY, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1})


@pytest.fixture(scope="module")
def prompts():
    found = random_prompts(5, VOCAB, 6, 40, seed=7)
    found[1] = (found[1][:5] * 8)[:38]  # repetitive: prompt lookup finds drafts
    return found


@pytest.fixture(scope="module")
def reference(target, prompts):
    return hf_greedy_tokens(target, prompts, MAX_TOKENS)


def methods(target, small_draft) -> dict:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            "draft_self": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4},
            "draft_small": {"method": "draft_model", "model": str(small_draft), "num_speculative_tokens": 2}}


def make(path, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", block_size=BLOCK, **{"num_kv_blocks": 96, **kw})


@pytest.fixture
def verify_as_decodes(monkeypatch, request):
    """Verification as a chunk (the prefill path) or as decode rows (the form CUDA graphs replay), eagerly."""
    from pagoda.speculative.decoder import SpeculativeDecoder

    init = SpeculativeDecoder.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.verify_as_decodes = request.param

    monkeypatch.setattr(SpeculativeDecoder, "__init__", patched)
    return request.param


@pytest.mark.parametrize("verify_as_decodes", [False, True], indirect=True, ids=["chunk", "rows"])
@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_small"])
def test_greedy_equals_transformers_with_chunked_prefill_and_preemption(target, small_draft, prompts, reference,
                                                                          method, verify_as_decodes):
    spec = methods(target, small_draft)[method]
    result, llm = check_greedy(target, prompts, MAX_TOKENS, expected=reference,
                               engine={"speculative_config": spec})
    decoder = llm.engine.speculative
    assert decoder.verify_as_decodes is verify_as_decodes
    assert (decoder.verified_as_decodes > 0) is verify_as_decodes  # the form under test ran
    result.assert_passed()
    stats = llm.get_stats()["speculative"]
    assert stats["draft_tokens"] > 0, stats  # verification ran
    if method == "draft_self":  # the target drafting for itself: (nearly) every draft is kept
        assert stats["acceptance_rate"] > 0.9, stats
    if method == "ngram":
        assert stats["accepted_tokens"] > 0, stats


def test_ngram_accepts_drafts_on_repetitive_text(target):
    pattern = random_prompts(1, VOCAB, 6, 6, seed=2)[0]
    llm = make(target, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = llm.generate([pattern * 6], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 32
    stats = llm.get_stats()["speculative"]
    assert stats["acceptance_rate"] > 0 and stats["mean_accepted_length"] > 1, stats
    assert len(stats["per_position_acceptance"]) == 4


def test_mixed_batch_stops_penalties_and_logprobs_equal_plain_decoding(target, prompts):
    plain = make(target)
    spec = make(target, speculative_config={"method": "draft_model", "model": str(target),
                                            "num_speculative_tokens": 4})
    free = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    stop_token = free[0].outputs[0].token_ids[6]  # stops the first request mid-draft
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens inside a draft
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),  # not speculating
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.5,
                             frequency_penalty=0.5, bad_words=None),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=5,
                             logit_bias={7: 3.0})]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
    assert got[0].outputs[0].token_ids[-1] == stop_token and len(got[0].outputs[0].token_ids) <= 7
    assert len(got[1].outputs[0].token_ids) == 7
    assert [list(x) for x in got[2].outputs[0].logprobs] == [list(x) for x in want[2].outputs[0].logprobs]
    assert spec.get_stats()["speculative"]["accepted_tokens"] > 0


def test_stop_string_cuts_inside_a_draft(target, prompts):
    plain = make(target)
    spec = make(target, speculative_config={"method": "draft_model", "model": str(target),
                                            "num_speculative_tokens": 4})
    free = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    text = free[0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(5, len(text) - 2) if text[i:i + 2].strip() and
                text.find(text[i:i + 2]) == i)  # first appears at character 5 or later
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    want, got = plain.generate(prompts[:1], params)[0], spec.generate(prompts[:1], params)[0]
    assert got.outputs[0].text == want.outputs[0].text and got.outputs[0].stop_reason == stop
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(got.outputs[0].token_ids) < MAX_TOKENS


def test_rejected_slots_are_given_back_and_hashes_cover_kept_tokens(target, prompts):
    llm = make(target, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
               enable_prefix_caching=True)
    engine = llm.engine
    bm = engine.block_manager
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    seen, burst = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():  # streaming: every accepted token is in the step's output
            n = len(out.outputs[0].token_ids)
            burst |= n - seen.get(out.request_id, 0) > 1
            seen[out.request_id] = n
        bm.check_invariants()
        for seq in engine.scheduler.running:
            assert seq.num_computed_tokens == seq.num_tokens - 1
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)  # no block of a rejected draft
            parent = 0
            for j, h in enumerate(seq.block_hashes):  # hashes over the kept tokens only
                parent = chain_hash(parent, tuple(seq.token_ids[j * BLOCK:(j + 1) * BLOCK]))
                assert h == parent
    assert burst, "no step emitted more than one token"
    assert all(n == MAX_TOKENS for n in seen.values())
    assert llm.get_stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(one_hot):
    """Over many draws, the first two tokens a verification yields follow the target's p0 and p1,
    whatever the draft proposed. Tolerance 0.025 on each probability of the first token: about 4.5
    standard deviations at 8000 draws; a sampler that kept every draft would be off by > 0.2."""
    gen = torch.Generator().manual_seed(0)
    vocab, draws = 5, 8000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1], [0.2] * 5])
    q = torch.tensor([[0.05, 0.1, 0.15, 0.2, 0.5], [0.4, 0.3, 0.1, 0.1, 0.1]])
    assert (p[:2] - q).abs().max() > 0.4  # the draft is far from the target
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    proposals = torch.multinomial(q, draws, replacement=True, generator=gen).T.tolist()  # [draws, 2]
    for d in proposals:
        if one_hot:
            d = [0, 2]  # a deterministic proposer always drafting the same tokens
        tokens, kept = accept_sampled(p, d, None if one_hot else q, gen)
        assert tokens[:kept] == d[:kept] and len(tokens) == kept + 1
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    assert (first / draws - p[0]).abs().max() < 0.025, first / draws
    assert second.sum() > 3000
    assert (second / second.sum() - p[1]).abs().max() < 0.04, second / second.sum()


def test_sampled_requests_are_reproducible_with_a_seed(target, prompts):
    llm = make(target, speculative_config={"method": "draft_model", "model": str(target),
                                           "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, presence_penalty=0.3, seed=5,
                            max_tokens=MAX_TOKENS, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert a == b and all(len(x) == MAX_TOKENS for x in a)
    assert llm.get_stats()["speculative"]["acceptance_rate"] > 0.9  # the target drafting for itself: q == p


def test_config_errors_name_the_key(target, tmp_path):
    for bad, words in [({"method": "mtp"}, "multi-token-prediction"), ({"method": "eagle3"}, "eagle3"),
                       ({"method": "ngram", "num_lookahead": 2}, "num_lookahead"),
                       ({"method": "draft_model"}, "needs 'model'"),
                       ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min")]:
        with pytest.raises(ConfigError, match="speculative_config") as info:
            make(target, speculative_config=bad)
        assert words in str(info.value)
    other = make_tiny_checkpoint("llama", tmp_path / "other", seed=1, **{**TINY, "vocab_size": 300})
    with pytest.raises(ConfigError, match="vocab_size 300 differs"):
        make(target, speculative_config={"method": "draft_model", "model": str(other)})


def test_cli_flag_and_metrics(target):
    from pagoda.cli.engine_args import add_engine_args, engine_config_from_args
    from pagoda.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config_from_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 5}
    llm = make(target, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm.generate([[5, 6, 7, 8] * 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stats = llm.get_stats()
    text = ServerMetrics().render(stats).decode()
    spec = stats["speculative"]
    assert f"pagoda_spec_decode_num_draft_tokens_total {float(spec['draft_tokens'])}" in text
    assert 'pagoda_spec_decode_per_position_acceptance{position="1"}' in text


def test_server_streams_verified_tokens_and_reports_them(target):
    import json

    import httpx
    from pagoda.config import EngineConfig
    from pagoda.server import ServerConfig, ServerThread, build_app

    engine = EngineConfig(model=str(target), device="cpu", dtype="float32", num_kv_blocks=64, block_size=BLOCK,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    plain = make(target).generate([[5, 6, 7, 8, 9] * 5], SamplingParams(temperature=0, max_tokens=16,
                                                                         ignore_eos=True))[0].outputs[0].text
    body = {"prompt": [5, 6, 7, 8, 9] * 5, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with ServerThread(build_app(engine, ServerConfig())) as srv:
        whole = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        chunks = []
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += [c["text"] for c in json.loads(line[6:])["choices"]]
        metrics = httpx.get(srv.url + "/metrics").text
    assert whole["choices"][0]["text"] == "".join(chunks) == plain
    assert whole["usage"]["completion_tokens"] == 16
    drafted = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("pagoda_spec_decode_num_draft_tokens_total"))
    assert drafted > 0
