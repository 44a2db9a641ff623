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

