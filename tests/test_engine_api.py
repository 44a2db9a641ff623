"""The engine's API beside generation: scoring a prompt between steps (``LLMEngine.score_prompt``, behind
``LLM.prompt_logits``) and dummy weights that follow the seed."""

import pytest
from pagoda import LLM
from pagoda.testing import make_tiny_checkpoint, random_prompts

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_scoring_a_prompt_between_steps_leaves_running_requests_alone(tmp_path):
    """``LLMEngine.score_prompt`` (behind ``LLM.prompt_logits``) borrows free blocks for one prefill and
    gives them back; a request decoding meanwhile gets the tokens it gets alone; bad prompts name the field."""
    import torch
    from pagoda import SamplingParams
    from pagoda.errors import RequestError

    path = make_tiny_checkpoint("llama", tmp_path / "m", seed=1, **TINY)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8, max_model_len=128)
    prompt, other = random_prompts(2, 320, 20, 30, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("r", prompt, params)
    engine.step()
    engine.step()
    scored = engine.score_prompt(other)
    assert scored.shape == (len(other), 320) and scored.dtype == torch.float32
    torch.testing.assert_close(scored, llm.prompt_logits(other))
    tokens = []
    while engine.has_unfinished_requests():
        tokens = [o for o in engine.step() if o.finished] or tokens
    assert tokens[0].outputs[0].token_ids == alone
    assert llm.get_stats()["kv_blocks_used"] == 0
    with pytest.raises(RequestError, match=r"\[0, 320\)") as bad:
        engine.score_prompt([1, 320])
    assert bad.value.field == "prompt"
    with pytest.raises(RequestError, match="max_model_len=128"):
        engine.score_prompt([1] * 129)


def test_dummy_weights_follow_the_seed_on_every_path(tmp_path, monkeypatch):
    """load_format dummy: the same seed and shapes give the same weights whatever was drawn before in the
    process (small tensors drawn on the host, large ones on their device; a speculative draft with the
    target's shapes is then the target), another seed other weights; norms are ones."""
    import torch
    from pagoda.loader import model_loader

    monkeypatch.setattr(model_loader, "DEVICE_DRAW_NUMEL", 10_000)  # embedding, gate_up, LM head: the device path
    path = make_tiny_checkpoint("llama", tmp_path / "m", seed=1, **TINY)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, block_size=8, max_model_len=64,
              load_format="dummy", seed=0)
    model = llm.engine.runner.model

    def weights(seed):
        torch.rand(1000)  # the process's generators move on between engines
        model_loader.init_dummy_weights(model, seed)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, b, c = weights(0), weights(0), weights(1)
    assert any(p.numel() >= 10_000 for p in a.values()) and any(p.numel() < 10_000 for p in a.values())
    for name, param in a.items():
        assert torch.equal(param, b[name]), name
        if "norm" in name:
            assert bool((param == 1).all())
        else:
            assert not torch.equal(param, c[name]), name


def test_truncate_prompt_tokens_offline():
    """SamplingParams(truncate_prompt_tokens=N) keeps the prompt's last N tokens (as vLLM's); a value the
    context cannot hold or that is not -1 / >= 1 is refused by name."""
    import tempfile

    import pytest
    from pagoda import LLM, SamplingParams
    from pagoda.errors import RequestError
    from pagoda.testing import make_tiny_checkpoint
    path = make_tiny_checkpoint("llama", tempfile.mkdtemp(), seed=2, vocab_size=128, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=64)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8, max_model_len=64)
    prompt = list(range(5, 25))
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(truncate_prompt_tokens=7, **greedy))[0]
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == llm.generate([prompt[-7:]], SamplingParams(**greedy))[0].outputs[0].token_ids
    with pytest.raises(RequestError) as info:
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=65, **greedy))
    assert info.value.field == "truncate_prompt_tokens"
    with pytest.raises(RequestError) as info:
        SamplingParams(truncate_prompt_tokens=0)
    assert info.value.field == "truncate_prompt_tokens"


def test_streamed_outputs_are_snapshots_without_copies(tmp_path):
    """An unfinished output's token ids and logprobs are windows of the sequence's own lists (no copy of the
    whole stream per step): each still reads as it did when it was made after later steps, compares and
    pickles as a list; the finished output holds lists of its own."""
    import pickle

    from pagoda import SamplingParams
    from pagoda.outputs import ListView

    path = make_tiny_checkpoint("llama", tmp_path / "m", seed=2, **TINY)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8, max_model_len=128)
    engine = llm.engine
    engine.add_request("r", random_prompts(1, 320, 10, 10, seed=3)[0],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    seen = []  # (output, its tokens and logprobs copied when it came)
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen.append((out, list(c.token_ids), list(c.logprobs)))
    assert len(seen) == 8 and [len(t) for _, t, _ in seen] == list(range(1, 9))
    for out, tokens, logprobs in seen[:-1]:
        c = out.outputs[0]
        assert isinstance(c.token_ids, ListView) and isinstance(c.logprobs, ListView)
        assert c.token_ids == tokens and c.logprobs == logprobs and c.token_ids[-1] == tokens[-1]
        assert pickle.loads(pickle.dumps(c.token_ids)) == tokens
    final = seen[-1][0].outputs[0]
    assert type(final.token_ids) is list and type(final.logprobs) is list
    assert final.token_ids[:7] == seen[-2][1]
