"""The sampler: greedy, filters, seeds independent of the batch, penalties, logprobs."""

import torch
from pagoda.engine.sampler import Sampler
from pagoda.engine.sampling_batch import sampling_rows
from pagoda.engine.sequence import Sequence
from pagoda.sampling_params import SamplingParams

V = 50


def sequences(*params, seeds=None):
    out = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", 0, [1, 2, 3], p, seed=(seeds or [None] * len(params))[i])
        if p.needs_penalties:
            s.output_counts = {}
        out.append(s)
    return out


def seqs(*params, seeds=None):
    """The sampler's batch for requests with ``params`` (as the engine copies it out of their sequences)."""
    return sampling_rows(sequences(*params, seeds=seeds))


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(4, V)
    s = seqs(SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
             SamplingParams(temperature=0.7, top_p=1e-6), SamplingParams(temperature=2.0, min_p=0.999))
    tokens = Sampler(torch.device("cpu")).__call__(logits, s).tokens
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.randn(1, V)
    top3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(torch.device("cpu"), seed=1)
    picks = {sampler(logits, seqs(SamplingParams(temperature=5.0, top_k=3))).tokens[0] for _ in range(200)}
    assert picks <= top3 and len(picks) > 1
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    picks = {sampler(logits, seqs(SamplingParams(top_p=0.5))).tokens[0] for _ in range(200)}
    assert picks <= nucleus


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    p = SamplingParams(temperature=1.0)
    alone = Sampler(torch.device("cpu"), seed=5)
    first = [alone(logits[1:2], seqs(p, seeds=[42])).tokens[0] for _ in range(1)]
    batched = Sampler(torch.device("cpu"), seed=99)
    s = seqs(p, p, p, seeds=[None, 42, 7])
    assert batched(logits, s).tokens[1] == first[0]


def test_penalties_follow_their_definitions():
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = -2.0
    rep = sequences(SamplingParams(temperature=0, repetition_penalty=2.0))[0]
    rep.token_ids += [5, 6]
    rep = sampling_rows([rep])[0]
    sampler = Sampler(torch.device("cpu"))
    from pagoda.logits_processors import apply_penalties as _apply_penalties

    row = logits[0].clone()
    _apply_penalties(row, rep)
    assert row[5] == 1.0 and row[6] == -4.0
    pres = sequences(SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5))[0]
    for t in (5, 5, 7):
        pres.append_token(t)
    pres = sampling_rows([pres])[0]
    row = logits[0].clone()
    _apply_penalties(row, pres)
    assert row[5] == 2.0 - 1.5 - 2 * 0.5 and row[7] == -2.0 and row[6] == -2.0
    assert sampler(logits, [pres]).tokens[0] not in (5, 7)


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(2, V)
    s = seqs(SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0))
    result = Sampler(torch.device("cpu"))(logits, s)
    chosen, rank, top = result.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert rank == 1 and abs(chosen - ref.max().item()) < 1e-6
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert result.logprobs[1] is None


def test_detokenizer_flushes_a_split_character_when_the_sequence_ends():
    from pagoda.engine.detokenizer import Detokenizer
    from pagoda.engine.sequence import SequenceStatus

    class ByteTokenizer:  # token id = one byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    seq = Sequence("d", 0, [65], SamplingParams())
    detok = Detokenizer(ByteTokenizer())
    seq.append_token(0xE6)  # the first byte of a 3-byte character
    detok.step([seq])
    assert seq.text == ""  # held back while the character may still complete
    seq.status = SequenceStatus.FINISHED_LENGTH
    detok.step([seq])
    assert seq.text == "\ufffd"


def test_decode_streams_give_the_windows_text_split_characters_included():
    """Where the tokenizer is a ``tokenizers.Tokenizer`` each sequence decodes through a DecodeStream primed with
    its prompt's last tokens: the same deltas as the windows (one token a step, or several), characters split over
    byte tokens held back and flushed when the sequence ends; a prompt ending inside a character keeps that
    sequence on the windows (a stream primed with it would hand the prompt's text out)."""
    from types import SimpleNamespace

    from pagoda.engine.detokenizer import Detokenizer
    from pagoda.engine.sequence import SequenceStatus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token a byte: characters split over tokens
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = SimpleNamespace(backend_tokenizer=backend)
    ids = backend.encode("naïve café 你好 😀 ok").ids
    prompts = {"ends cleanly": backend.encode("say: ").ids, "ends inside a character": backend.encode("ab é").ids[:-1]}
    for name, prompt in prompts.items():
        texts = []
        for streams in (True, False):
            detok = Detokenizer(tokenizer)
            if not streams:
                detok._stream_class = None
            seq, deltas, at = Sequence("d", 0, prompt, SamplingParams()), [], 0
            for size in [1, 3, 1, 2] * 10:  # (several tokens a step: speculative decoding's)
                for t in ids[at:at + size]:
                    seq.append_token(t)
                at += size
                deltas += detok.step([seq])
                if at >= len(ids):
                    break
            texts.append((seq.text, "".join(deltas), seq.decode_stream is False))
        assert texts[0][:2] == texts[1][:2] == ("naïve café 你好 😀 ok",) * 2, name
        assert texts[0][2] is (name == "ends inside a character")  # (windows for that one)
    detok = Detokenizer(tokenizer)  # a character split at the end: held back, then flushed
    seq = Sequence("d", 0, backend.encode("x").ids, SamplingParams())
    for step in (backend.encode("a").ids, backend.encode("你").ids[:-1]):
        for t in step:
            seq.append_token(t)
        detok.step([seq])
    assert seq.text == "a" and isinstance(seq.decode_stream, list)
    seq.status = SequenceStatus.FINISHED_LENGTH
    detok.step([seq])
    assert seq.text.startswith("a\ufffd")


def test_the_flags_the_engine_reads_every_step_follow_assigned_fields():
    """needs_processing, argmax_only and samples_on_device are computed once per SamplingParams (the engine
    reads them for every row of every step) and recomputed after a field is assigned."""
    import dataclasses
    import pickle

    params = SamplingParams(temperature=0)
    assert params.argmax_only and params.samples_on_device and not params.needs_processing
    params.repetition_penalty = 1.3  # (a server route may set fields after building the params)
    assert params.needs_penalties and params.needs_processing
    assert not params.argmax_only and not params.samples_on_device
    params.repetition_penalty, params.logprobs = 1.0, 2
    assert not params.needs_processing and not params.argmax_only and not params.samples_on_device
    copy = pickle.loads(pickle.dumps(params))
    assert copy == params and not copy.samples_on_device
    assert dataclasses.replace(params, logprobs=None).argmax_only


def test_processing_moves_the_pick_and_reports_the_raw_logprobs():
    # a logit bias moves the pick; the logprobs are the raw distribution's, float32 or bf16 (the sampler may
    # process float32 logits in the caller's own tensor: no caller reads them afterwards; with logprobs it
    # keeps them raw)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(2, V).to(dtype)
        before = logits.clone()
        low = int(logits[0].float().argmin())
        biased = SamplingParams(temperature=0, logit_bias={low: 100.0}, logprobs=1)
        plain = SamplingParams(temperature=0, logit_bias={low: 100.0})
        for params in (biased, plain):  # with logprobs (the raw kept) and without (processed in place)
            result = Sampler(torch.device("cpu"))(before.clone(), seqs(params, params))
            assert result.tokens == [low, low]
        chosen, rank, _ = Sampler(torch.device("cpu"))(logits, seqs(biased)).logprobs[0]
        assert rank == V and abs(chosen - torch.log_softmax(before[0].float(), -1)[low].item()) < 1e-5
        assert torch.equal(logits, before)  # (the raw logits were read after the pick: kept)


def test_choosing_on_the_device_matches_the_sampler():
    for dtype in (torch.float32, torch.bfloat16):
        before = torch.randn(3, V).to(dtype)
        for params in ([SamplingParams(temperature=0)] * 3,
                       [SamplingParams(temperature=1.0, seed=5)] * 3,
                       [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
                        SamplingParams(temperature=0)]):
            device = Sampler(torch.device("cpu")).select_on_device(before.clone(), seqs(*params, seeds=[1, 2, 3]))
            host = Sampler(torch.device("cpu"))(before.clone(), seqs(*params, seeds=[1, 2, 3]))
            assert device.tokens.tolist() == host.tokens and device.tokens.dtype == torch.int64


def test_the_row_argmax_is_torchs_argmax_ties_and_nans_included():
    from pagoda.engine.sampler import row_argmax

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for trial in range(60):
            t = torch.randint(0, 4, (7, 300), generator=gen).to(dtype)  # many equal maxima: the first wins
            if trial % 3 == 0:
                t[trial % 7, (trial * 7) % 300] = float("nan")  # a NaN counts as the largest
            if trial % 5 == 0:
                t[1] = float("-inf")
            assert torch.equal(row_argmax(t), t.argmax(dim=-1)), (dtype, trial)


def test_sampling_rows_copy_what_the_sampler_reads_and_drafts_extend_them_without_touching_the_sequence():
    from pagoda.engine.sequence import SequenceStatus

    seq = sequences(SamplingParams(temperature=0, presence_penalty=1.0), seeds=[3])[0]
    seq.append_token(9)
    row = sampling_rows([seq])[0]
    assert (row.seq_id, row.seed, row.num_prompt_tokens, row.output_token_ids, row.output_counts, row.finished) == (
        seq.seq_id, 3, 3, [9], {9: 1}, False)
    ahead = row.as_if_generated([9, 4])  # (speculative decoding: a draft position's history)
    assert ahead.output_token_ids == [9, 9, 4] and ahead.num_output_tokens == 3 and ahead.output_counts == {9: 2, 4: 1}
    assert row.output_token_ids == [9] and seq.token_ids == [1, 2, 3, 9] and seq.output_counts == {9: 1}
    seq.status = SequenceStatus.FINISHED_STOPPED
    assert sampling_rows([seq])[0].finished  # (a row chosen after its sequence ended takes the argmax)
