"""A replica's outputs sent as deltas (pagoda.distributed.output_deltas) come out at the front equal to the
cumulative outputs they stand for, through pickling, with n > 1, logprobs, prompt logprobs, a text cut back
at a stop string and an abort while a delta is on its way; and a step's message stays small however long
the request has run."""

import pickle

from pagoda.distributed.output_deltas import OutputReceiver, OutputSender, is_delta
from pagoda.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

PROMPT = list(range(500))


def _output(rid: str, step: int, n: int = 2, finished: bool = False, cut: int = 0) -> RequestOutput:
    """Step ``step`` of a request: completion i has step + 1 + i tokens, their text and logprobs."""
    outs = []
    for i in range(n):
        ids = [1000 + 7 * i + t for t in range(step + 1 + i)]
        text = "".join(f"<{t}>" for t in ids)
        outs.append(CompletionOutput(i, text[:len(text) - cut] if cut else text, ids, -0.5 * len(ids),
                                     [{t: Logprob(-0.5, 1, f"<{t}>")} for t in ids],
                                     "stop" if finished else None, "</s>" if finished else None))
    return RequestOutput(rid, "p", PROMPT, outs, finished, RequestMetrics(1.0, 2.0), 8,
                         prompt_logprobs=[None] + [{t: Logprob(-1.0, 1)} for t in PROMPT[1:]])


def _through(sender: OutputSender, receiver: OutputReceiver, outputs: list[RequestOutput]) -> list[RequestOutput]:
    message = pickle.dumps(sender.encode(outputs))
    return receiver.decode(pickle.loads(message))


def test_deltas_rebuild_the_cumulative_outputs():
    sender, receiver = OutputSender(), OutputReceiver()
    sizes = []
    for step in range(40):
        want = [_output("a", step), _output("b", step, n=1)]
        encoded = sender.encode(want)
        sizes.append(len(pickle.dumps(encoded)))
        assert all(is_delta(e) for e in encoded) == (step > 0)
        assert receiver.decode(pickle.loads(pickle.dumps(encoded))) == want
    assert sizes[-1] < sizes[1] * 1.2 and sizes[1] < sizes[0] / 10  # O(new) per step, not O(length)
    last = [_output("a", 40, finished=True, cut=5), _output("b", 40, n=1, finished=True)]  # "a" cut at a stop
    assert _through(sender, receiver, last) == last
    assert not sender._sent and not receiver._last  # finished requests are forgotten on both sides


def test_an_aborted_requests_delta_in_flight_is_dropped_and_a_new_request_starts_whole():
    sender, receiver = OutputSender(), OutputReceiver()
    assert _through(sender, receiver, [_output("a", 0)]) == [_output("a", 0)]
    in_flight = pickle.dumps(sender.encode([_output("a", 1), _output("c", 0)]))
    receiver.forget(["a"])  # the front aborted "a" while the replica was sending its delta
    sender.forget(["a"])
    assert receiver.decode(pickle.loads(in_flight)) == [_output("c", 0)]
    assert _through(sender, receiver, [_output("a", 5)]) == [_output("a", 5)]  # an id used again: whole


def test_a_completion_whose_tokens_changed_is_sent_whole():
    sender, receiver = OutputSender(), OutputReceiver()
    first = _output("a", 3, n=1)
    _through(sender, receiver, [first])
    changed = _output("a", 4, n=1)
    changed.outputs[0].token_ids[3] = 9  # (never happens in the engine: the check makes it safe)
    assert _through(sender, receiver, [changed]) == [changed]



def test_streamed_outputs_share_one_list_and_stay_snapshots():
    """The front extends one list per completion instead of copying it every step (O(new) per step): each
    streamed output still reads as it was when it arrived, compares and pickles as a list, and the final
    output has lists of its own."""
    from pagoda.outputs import ListView

    sender, receiver = OutputSender(), OutputReceiver()
    seen = [_through(sender, receiver, [_output("a", step, n=1)])[0] for step in range(6)]
    ids = [o.outputs[0].token_ids for o in seen]
    assert all(isinstance(t, ListView) for t in ids[1:])
    assert ids[2].items is ids[5].items  # one list, extended in place
    assert seen[3].outputs[0].logprobs.items is seen[5].outputs[0].logprobs.items
    for step, (out, t) in enumerate(zip(seen, ids)):
        assert out == _output("a", step, n=1)  # earlier snapshots unchanged by the later deltas
        assert t == [1000 + k for k in range(step + 1)] and len(t) == step + 1 and t[-1] == 1000 + step
        assert t[1:3] == [1001, 1002][:len(t) - 1] and t[::-1] == list(reversed(list(t)))
        assert pickle.loads(pickle.dumps(t)) == list(t) and type(pickle.loads(pickle.dumps(t))) is list
    final = _through(sender, receiver, [_output("a", 6, n=1, finished=True)])[0]
    assert type(final.outputs[0].token_ids) is list and type(final.outputs[0].logprobs) is list
    assert final == _output("a", 6, n=1, finished=True) and seen[5] == _output("a", 5, n=1)


def test_an_engines_own_deltas_equal_the_deltas_of_its_outputs(tmp_path):
    """The engine process makes its deltas from the requests (``OutputSender.output_of`` as the engine's
    ``build_output``) instead of from cumulative outputs: through pickling, the front rebuilds exactly the
    outputs the engine would have returned, step by step, with n = 2, logprobs, prompt logprobs, a stop string
    that cuts the text back, a request failing inside a step, an abort and a request ending by length."""
    from pagoda import LLM, SamplingParams
    from pagoda.engine.step_completion import request_output
    from pagoda.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path, seed=3, tokenizer=True, vocab_size=320, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=128)
    engine = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8).engine
    sender, receiver = OutputSender(), OutputReceiver()
    engine.completion.build_output = lambda request, finished: (sender.output_of(request, finished),
                                                                request_output(request, finished))
    plain = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine.add_request("n2", "hello there", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10,
                                                           logprobs=2, prompt_logprobs=1, ignore_eos=True))
    engine.add_request("abort", "abc", plain)
    engine.add_request("length", "xyz", plain)
    steps, deltas, finals = 0, 0, {}
    while engine.has_unfinished_requests():
        pairs = engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("abort")
            sender.forget(["abort"])
            receiver.forget(["abort"])
            pairs = [p for p in pairs if p[1].request_id != "abort"]
        if steps == 4:  # a stop string: the seeded text so far, which the same prompt and seed meet again and cuts
            text = next(p[1] for p in pairs if p[1].request_id == "length").outputs[0].text
            assert len(text) >= 2
            engine.add_request("stop", "xyz", SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                                                                stop=[text[-2:]]))
        wire = sender.encode([sent for sent, _ in pairs])
        deltas += sum(map(is_delta, wire))
        got = receiver.decode(pickle.loads(pickle.dumps(wire)))
        assert got == [want for _, want in pairs]
        finals.update({out.request_id: out for out in got if out.finished})
    assert steps > 8 and deltas > 10 and set(finals) == {"n2", "length", "stop"}
    assert finals["stop"].outputs[0].stop_reason == text[-2:] and finals["length"].outputs[0].finish_reason == "length"
    assert not sender._sent and not receiver._last
