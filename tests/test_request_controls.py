"""What a request does to its own generation: prompt logprobs (against transformers, through chunked
prefill, not lost to the prefix cache), logit_bias, allowed_token_ids, bad_words, min_tokens."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.errors import RequestError
from pagoda.testing import make_tiny_checkpoint
from pagoda.testing.reference import load_reference_model

VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("controls"), seed=7, tokenizer=True, **TINY)


@pytest.fixture(scope="module")
def llm(checkpoint):
    # a 16-token step budget: a 40-token prompt prefills in three chunks
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8,
               max_num_batched_tokens=16)


def test_prompt_logprobs_match_transformers_through_chunks_and_the_cache(llm, checkpoint):
    prompt = [(i * 37 + 11) % 250 + 4 for i in range(40)]
    with torch.no_grad():
        ref = torch.log_softmax(load_reference_model(checkpoint)(torch.tensor([prompt])).logits[0].float(), -1)
    llm.generate([prompt], SamplingParams(**GREEDY))  # the prompt's blocks are now in the prefix cache
    out = llm.generate([prompt], SamplingParams(prompt_logprobs=3, **GREEDY))[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        entry = lps[pos]
        token = prompt[pos]
        assert abs(entry[token].logprob - ref[pos - 1, token].item()) < 1e-4
        assert entry[token].rank == int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1
        top = ref[pos - 1].topk(3)
        assert [t for t, lp in entry.items() if lp.rank <= 3][:3] == top.indices.tolist() or \
            {t for t, lp in entry.items() if lp.rank <= 3} == set(top.indices.tolist())
    plain = llm.generate([prompt], SamplingParams(**GREEDY))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids and plain.prompt_logprobs is None


def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    prompt = [[9, 10, 11, 12]]
    assert set(llm.generate(prompt, SamplingParams(logit_bias={77: 100.0}, **GREEDY))[0].outputs[0].token_ids) == {77}
    assert set(llm.generate(prompt, SamplingParams(logit_bias={77: 1e6}, **GREEDY))[0].outputs[0].token_ids) == {77}
    allowed = llm.generate(prompt, SamplingParams(allowed_token_ids=[50, 51], temperature=1.0, seed=1,
                                                  max_tokens=20, ignore_eos=True))[0]
    assert set(allowed.outputs[0].token_ids) <= {50, 51}
    plain = llm.generate(prompt, SamplingParams(**GREEDY))[0].outputs[0]
    word = llm.get_tokenizer().decode(plain.token_ids[:1])
    banned = llm.generate(prompt, SamplingParams(bad_words=[word], **GREEDY))[0].outputs[0]
    assert plain.token_ids[0] not in banned.token_ids


def test_min_tokens_holds_back_eos(llm):
    prompt = [[9, 10, 11, 12]]
    eos = 1  # the byte tokenizer's </s>
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=5))[0]
    ids = out.outputs[0].token_ids
    assert eos not in ids[:5] and ids[5] == eos and out.outputs[0].finish_reason == "stop" and len(ids) == 6


@pytest.mark.parametrize("kwargs,field", [({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
                                          ({"allowed_token_ids": []}, "allowed_token_ids"),
                                          ({"bad_words": [" "]}, "bad_words"),
                                          ({"prompt_logprobs": 99}, "prompt_logprobs"),
                                          ({"logits_processors": ["nope"]}, "logits_processors")])
def test_bad_controls_are_refused_naming_the_field(llm, kwargs, field):
    with pytest.raises(RequestError) as info:
        llm.generate([[1, 2]], SamplingParams(**kwargs))
    assert info.value.field == field
