"""Structured outputs: the grammar backends (xgrammar, llguidance) behind pagoda's interface, the
compile cache and its errors, and the engine keeping every constrained output inside its grammar."""

import json
import random
import re

import jsonschema
import pytest
import torch
from pagoda.errors import RequestError
from pagoda.structured_outputs.backends import GrammarMatcher, apply_bitmask, fill_bitmasks
from pagoda.structured_outputs.manager import StructuredOutputManager
from pagoda.structured_outputs.params import StructuredOutputsParams
from pagoda.testing.reference import save_byte_tokenizer
from transformers import AutoTokenizer

VOCAB = 300  # the byte tokenizer uses 260 ids; the model's vocabulary is padded past it
EOS = 1
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(directory, VOCAB)
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module", params=["xgrammar", "llguidance", "xgrammar-process"])
def manager(request, tokenizer):
    """Each backend; xgrammar-process: xgrammar's matchers in a grammar process (structured_outputs_process)."""
    name = request.param.removesuffix("-process")
    manager = StructuredOutputManager(name, tokenizer, VOCAB, [EOS], process=request.param.endswith("-process"))
    yield manager
    manager.shutdown()


def walk(manager, params, tokenizer, seed=0, limit=200):
    """Generate through the grammar's masks alone: each step a random allowed token."""
    matcher = manager.compile(params).matcher()
    rng = random.Random(seed)
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    out = []
    for _ in range(limit):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.zeros(1, VOCAB)
        apply_bitmask(logits, bitmask)
        allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
        assert allowed, "the grammar allows nothing"
        assert all(t < 260 for t in allowed), "a padded id past the tokenizer was allowed"
        # prefer ending once allowed, so walks stay short
        token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept(token)
        if matcher.terminated:
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_validate(manager, tokenizer, seed):
    text = walk(manager, StructuredOutputsParams(json=SCHEMA), tokenizer, seed)
    # xgrammar's JSON strings admit raw control characters (a random walk finds them; models hardly
    # emit them), which Python's strict parser refuses: parse as most JSON parsers do
    obj = json.loads(text, strict=False)
    jsonschema.validate(obj, SCHEMA)
    order = list(SCHEMA["properties"])  # properties come in the schema's order (not sorted: age < name)
    assert list(obj) == sorted(obj, key=order.index)


def test_regex_choice_grammar_and_json_object(manager, tokenizer):
    assert re.fullmatch(r"[a-c]{2,4}-\d", walk(manager, StructuredOutputsParams(regex=r"[a-c]{2,4}-\d"), tokenizer))
    choices = ["yes", "no", 'say "hi"\n', "café"]
    for seed in range(3):
        assert walk(manager, StructuredOutputsParams(choice=choices), tokenizer, seed) in choices
    ebnf = 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] digits'
    assert re.fullmatch(r"\(\d+\)", walk(manager, StructuredOutputsParams(grammar=ebnf), tokenizer))
    obj = StructuredOutputsParams(json_object=True)
    assert accepts(manager, obj, tokenizer, '{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts(manager, obj, tokenizer, '[1, 2]') and not accepts(manager, obj, tokenizer, '{"a": 1')


def accepts(manager, params, tokenizer, text):
    """Whether the grammar's masks let ``text`` through, then end."""
    matcher = manager.compile(params).matcher()
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for token in [*tokenizer.encode(text, add_special_tokens=False), EOS]:
        matcher.fill_bitmask(bitmask, 0)
        if not (bitmask[0, token // 32] >> (token % 32)) & 1:
            return False
        matcher.accept(token)
    return matcher.terminated


def test_batched_fill_equals_one_row_at_a_time(manager, tokenizer):
    """The libraries' batched (threaded) fill writes the same rows as the per-row fill, at any row."""
    grammars = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-c]{2,4}-\d"),
                StructuredOutputsParams(choice=["yes", "no"])]
    matchers = [manager.compile(g).matcher() for g in grammars]
    for m, prefix in zip(matchers, ['{"name":"ab', "ab", "y"]):
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert m.accept(token)
    rows = [4, 0, 2]
    batched = torch.zeros(5, (VOCAB + 31) // 32, dtype=torch.int32)
    fill_bitmasks(list(zip(matchers, rows)), batched)
    single = torch.zeros_like(batched)
    for m, row in zip(matchers, rows):
        m.fill_bitmask(single, row)
    assert torch.equal(batched, single) and bool((batched[rows] != 0).any(dim=1).all())
    # every filled row is written whole, the padded ids past the tokenizer's included (the fill ahead starts
    # from uninitialised memory); rows given in order take the copy path, in any order the gather path
    for order in ([0, 1, 2], rows):
        for sentinel in (0x5A5A5A5A, -0x5A5A5A5B):
            mask = torch.full((5, (VOCAB + 31) // 32), sentinel, dtype=torch.int32)
            fill_bitmasks(list(zip(matchers, order)), mask)
            assert not bool((mask[order] == sentinel).any()) and torch.equal(mask[order], single[rows])
            assert bool((mask[[r for r in range(5) if r not in order]] == sentinel).all())


def test_greedy_constrained_rows_are_masked_in_the_logits_own_dtype(manager, tokenizer):
    """Greedy rows that only a grammar constrains are masked and picked in the logits' own dtype (bfloat16 on a
    GPU: no float32 copy between two forwards), in place, with the tokens of the float32 path; a row that also
    has its own processing (or a random row) still works in a float32 copy."""
    from pagoda import SamplingParams
    from pagoda.engine.sampler import Sampler
    from pagoda.engine.sampling_batch import sampling_rows
    from pagoda.engine.sequence import Sequence

    def rows(*params):
        seqs = []
        for i, p in enumerate(params):
            seq = Sequence(f"r{i}", i, [1, 2, 3], p)
            seq.grammar = manager.compile(StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]")).matcher()
            seq.output_counts = {}
            seqs.append(seq)
        return sampling_rows(seqs)

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen).to(torch.bfloat16)
    greedy = SamplingParams(temperature=0)
    in_place = logits.clone()
    chosen = Sampler(torch.device("cpu")).select_on_device(in_place, rows(greedy, greedy, greedy)).tokens.tolist()
    upcast = Sampler(torch.device("cpu")).select_on_device(logits.float(), rows(greedy, greedy, greedy))
    assert chosen == upcast.tokens.tolist()
    allowed = {tokenizer.convert_tokens_to_ids(c) for c in "abc"}
    assert set(chosen) <= allowed and bool(torch.isneginf(in_place).any())  # masked where it lies
    penalised = SamplingParams(temperature=0, repetition_penalty=1.3)
    untouched = logits.clone()
    Sampler(torch.device("cpu")).select_on_device(untouched, rows(penalised, greedy, greedy))
    assert torch.equal(untouched, logits)  # (a float32 copy was processed)


def test_compile_errors_name_the_field(manager):
    with pytest.raises(RequestError) as info:
        manager.compile(StructuredOutputsParams(regex="(unclosed"))
    assert info.value.field == "structured_outputs.regex" and "does not compile" in str(info.value)
    with pytest.raises(RequestError) as info:
        manager.compile(StructuredOutputsParams(json={"type": "nonsense"}), field="response_format")
    assert info.value.field == "response_format"


@pytest.mark.parametrize("kwargs,field", [({}, "structured_outputs"),
                                          ({"json": "{not json"}, "structured_outputs.json"),
                                          ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
                                          ({"choice": []}, "structured_outputs.choice"),
                                          ({"json_object": False, "grammar": ""}, "structured_outputs.grammar")])
def test_params_are_checked_where_they_enter(kwargs, field):
    with pytest.raises(RequestError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.field == field


def test_the_cache_compiles_a_grammar_once(tokenizer, monkeypatch):
    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [EOS])
    backend = manager.backend("xgrammar")
    calls = []
    real = backend.compile
    monkeypatch.setattr(backend, "compile", lambda spec: calls.append(spec) or real(spec))
    futures = [manager.compile_async(StructuredOutputsParams(json=dict(SCHEMA))) for _ in range(4)]
    first = futures[0].result()
    assert all(f.result() is first for f in futures[1:]) or len(calls) <= 2
    manager.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))  # the same schema as text: cached
    assert len(calls) <= 2  # (two may race on the very first compile; the cache then holds one)
    assert len(manager._cache) == 1


def test_auto_falls_back_to_llguidance(tokenizer, monkeypatch):
    manager = StructuredOutputManager("auto", tokenizer, VOCAB, [EOS])

    def refuse(spec):
        raise ValueError("unsupported by this backend")

    monkeypatch.setattr(manager.backend("xgrammar"), "compile", refuse)
    grammar = manager.compile(StructuredOutputsParams(regex="ab+"))
    assert grammar.backend.name == "llguidance"
    monkeypatch.setattr(manager.backend("llguidance"), "compile", refuse)
    with pytest.raises(RequestError, match="unsupported by this backend"):
        manager.compile(StructuredOutputsParams(regex="cd+"))


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from pagoda.testing import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("so"), seed=5, tokenizer=True, vocab_size=VOCAB,
                                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512)


def _llm(path, pipelined=False):
    from pagoda import LLM

    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=256, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=64)
    if pipelined:  # (on by default where the platform queues work: CUDA; on the CPU switched on)
        llm.engine.enable_step_pipeline()
    return llm


@pytest.fixture(scope="module")
def llm(checkpoint):
    return _llm(checkpoint)


def constrained(so, **kwargs):
    from pagoda import SamplingParams

    return SamplingParams(structured_outputs=so, **{"max_tokens": 120, "temperature": 0.8, "seed": 3, **kwargs})


def eight_grammars():
    """Eight requests: four JSON schemas, a regex, a choice (n=2), an EBNF grammar (sampled, seeded; the
    grammar greedy) and an unconstrained greedy request; their prompts."""
    from pagoda import SamplingParams

    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": i, "maximum": i + 9}},
                "required": [f"k{i}"], "additionalProperties": False} for i in range(4)]
    params = [constrained(StructuredOutputsParams(json=s, disable_any_whitespace=True)) for s in schemas]
    params += [constrained(StructuredOutputsParams(regex=r"(ab|cd){2,3}!")),
               constrained(StructuredOutputsParams(choice=["red", "green", "blue"]), n=2),
               constrained(StructuredOutputsParams(grammar='root ::= "<" [0-9] [0-9]? ">"'), temperature=0),
               SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]  # unconstrained, in the same batch
    prompts = [[5 + i, 40 + i, 77] * (3 + i) for i in range(len(params))]
    return schemas, params, prompts


def test_the_engine_keeps_every_output_inside_its_grammar(llm):
    """A random model through the masks: eight requests with eight grammars in one batch (sampled,
    seeded, n=2 for one), chunked prefill, each output valid for its own grammar."""
    schemas, params, prompts = eight_grammars()
    outs = llm.generate(prompts, params)
    for i, schema in enumerate(schemas):
        jsonschema.validate(json.loads(outs[i].outputs[0].text), schema)
        assert outs[i].outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"(ab|cd){2,3}!", outs[4].outputs[0].text)
    assert {c.text for c in outs[5].outputs} <= {"red", "green", "blue"} and len(outs[5].outputs) == 2
    assert re.fullmatch(r"<\d\d?>", outs[6].outputs[0].text)
    alone = llm.generate([prompts[7]], params[7])[0]
    assert outs[7].outputs[0].token_ids == alone.outputs[0].token_ids  # unconstrained rows are untouched


def test_a_grammar_cut_by_max_tokens_ends_with_length(llm):
    out = llm.generate([[7, 8, 9]], constrained(StructuredOutputsParams(regex=r"[a-z]{50}"), max_tokens=5))[0]
    assert out.outputs[0].finish_reason == "length" and re.fullmatch(r"[a-z]{5}", out.outputs[0].text)


def test_a_grammar_that_does_not_compile_is_the_requests_error(llm):
    with pytest.raises(RequestError) as info:
        llm.generate([[1, 2]], constrained(StructuredOutputsParams(regex="(")))
    assert info.value.field == "structured_outputs.regex"
    assert llm.get_stats()["num_waiting"] == 0


def test_masks_filled_ahead_give_the_same_outputs(llm):
    """The next step's masks are filled on a worker thread while the engine finishes its step
    (pagoda.structured_outputs.mask_ahead): the sampler takes those rows, and the outputs are the
    ones of masks filled in the step itself, for sampled and greedy rows, several grammars at once."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = [constrained(StructuredOutputsParams(json=schema, disable_any_whitespace=True), seed=s) for s in (1, 2)]
    params += [constrained(StructuredOutputsParams(regex=r"(ab|cd){2,4}!"), temperature=0)]
    prompts = [[9, 10 + i, 11] * 3 for i in range(len(params))]
    engine = llm.llm_engine if hasattr(llm, "llm_engine") else llm.engine
    ahead = engine.mask_ahead
    used = ahead.rows_used
    with_ahead = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ahead.rows_used > used + 10  # most rows came from the fill ahead
    engine.runner.sampler.mask_ahead = None
    try:
        in_step = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        engine.runner.sampler.mask_ahead = ahead
    assert with_ahead == in_step


@pytest.mark.parametrize("process", [False, True])
def test_a_stale_or_failed_fill_ahead_is_filled_in_the_step(tokenizer, process):
    """A row whose matcher accepted a token after the fill ahead started is filled again; a fill
    ahead that raised leaves every row to the step's own fill. Matchers in a grammar process: the same,
    the rows in shared memory (uploaded through a pinned copy: ``pinned`` is False)."""
    from types import SimpleNamespace

    from pagoda.structured_outputs.mask_ahead import MaskAhead

    def running(matcher):  # what start() reads of a sequence
        return SimpleNamespace(grammar=matcher, is_finished=False, request_id="r")

    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id], process=process)
    grammar = manager.compile(StructuredOutputsParams(regex="ab+c"))
    first, second = grammar.matcher(), grammar.matcher()
    ahead, words = MaskAhead(), (VOCAB + 31) // 32
    ahead.width = words
    ahead.start([running(first), running(second)])
    first.accept(tokenizer.convert_tokens_to_ids("a"))  # (the engine waits first; here: made stale on purpose)
    ready = ahead.take([first, second], words)
    assert ready.where == [-1, 1] and ready.none_left == [False, False] and ready.pinned is not process
    want = torch.zeros(1, second.words, dtype=torch.int32)  # (the library's width: the tokenizer's ids)
    second.fill_bitmask(want, 0)
    assert torch.equal(ready.bitmask[1], want[0])

    class Broken:
        terminated, accepted = False, 0

        def fill_bitmask(self, bitmask, row):
            raise RuntimeError("no")

    ahead.start([running(Broken())])
    assert ahead.take([second], words) is None
    ahead.close()
    manager.shutdown()


def test_a_grammar_process_s_rows_are_pinned_in_place_where_the_platform_can(tokenizer):
    """With ``Platform.pin_in_place`` (the CUDA platform's page-locks memory as it lies) each shared buffer of the
    fills ahead is pinned once, when made: its rows are then uploaded as they are (``pinned``), and unpinned
    before the process's memory goes; the step's own fills (a buffer of their own) are never pinned."""
    from types import SimpleNamespace

    from pagoda.structured_outputs.mask_ahead import MaskAhead
    from pagoda.structured_outputs.masking import apply_grammar_masks

    pinned, unpinned = [], []

    def pin_in_place(host):
        pinned.append((host.data_ptr(), host.numel()))
        return lambda: unpinned.append(host.data_ptr())

    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id], process=True)
    grammar = manager.compile(StructuredOutputsParams(regex="ab+c"))
    first, second = grammar.matcher(), grammar.matcher()
    ahead, words = MaskAhead(pin_in_place=pin_in_place), (VOCAB + 31) // 32
    ahead.width = words
    for step in range(3):  # two buffers take turns: pinned once each
        ahead.start([SimpleNamespace(grammar=m, is_finished=False, request_id="r") for m in (first, second)])
        logits = torch.zeros(2, VOCAB)
        assert apply_grammar_masks(logits, [(0, first, None), (1, second, None)], ahead, {}) == []
        assert ahead.rows_used == 2 * (step + 1)  # (the fill ahead's rows, pinned, not the step's own)
        allowed = (logits[0] == 0).nonzero().flatten().tolist()
        assert allowed == [tokenizer.convert_tokens_to_ids("a")] and torch.equal(logits[0], logits[1])
    first.fill_bitmask(torch.zeros(1, words, dtype=torch.int32), 0)  # a fill now: its own buffer, not pinned
    assert len(pinned) == 2 and not unpinned
    ahead.start([SimpleNamespace(grammar=first, is_finished=False, request_id="r")])
    assert ahead.take([first], words).pinned
    manager.shutdown()
    assert sorted(unpinned) == sorted(ptr for ptr, _ in pinned)


def test_fills_ahead_shorten_the_gil_switch_interval_until_closed(tokenizer, monkeypatch):
    """While a MaskAhead has its worker, CPython's GIL switch interval is at most SWITCH_INTERVAL (the worker
    then hands its rows back before the sampler asks for them); the process's own interval comes back
    when the last one closes."""
    import sys
    from types import SimpleNamespace

    from pagoda.structured_outputs import mask_ahead
    from pagoda.structured_outputs.mask_ahead import SWITCH_INTERVAL, MaskAhead

    monkeypatch.setattr(mask_ahead, "_switch_users", [0, None])  # (apart from other tests' engines)
    own = sys.getswitchinterval()
    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    grammar = manager.compile(StructuredOutputsParams(regex="ab+c"))
    try:
        sys.setswitchinterval(0.005)
        one, two = MaskAhead(), MaskAhead()
        for ahead in (one, two):
            ahead.width = (VOCAB + 31) // 32
            ahead.start([SimpleNamespace(grammar=grammar.matcher(), is_finished=False, request_id="r")])
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
        one.close()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)  # (two still fills ahead)
        two.close()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(own)


def test_engine_shutdown_ends_the_mask_worker_and_the_grammar_process(checkpoint):
    llm = _llm(checkpoint)
    llm.generate([[1, 2, 3]], constrained(StructuredOutputsParams(regex="(ab)+c"), max_tokens=4))
    ahead = llm.engine.mask_ahead
    assert ahead._worker is not None
    llm.shutdown()
    assert ahead._worker is None
    from pagoda import LLM

    remote = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
                 structured_outputs_process=True)
    remote.generate([[1, 2, 3]], constrained(StructuredOutputsParams(regex="(ab)+c"), max_tokens=4))
    process = remote.engine.controls.structured_outputs.backend("xgrammar").process._proc
    assert process.poll() is None
    remote.shutdown()
    assert process.poll() is not None


@pytest.fixture(scope="module")
def remote_manager(tokenizer):
    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [EOS], process=True)
    yield manager
    manager.shutdown()


def test_a_token_the_grammar_process_refuses_fails_the_next_fill(remote_manager, tokenizer):
    """An accept is only queued (its reply comes with the next message): a token the grammar refuses (a bug
    upstream: the mask never allows one) marks its matcher, and that matcher's next fill raises, naming the
    token; the other matchers of the same fill are untouched."""
    grammar = remote_manager.compile(StructuredOutputsParams(regex=r"[a-c]{2,4}"))
    bad, good = grammar.matcher(), grammar.matcher()
    z, a = (tokenizer.convert_tokens_to_ids(c) for c in "za")
    assert bad.accept(z) and good.accept(a)  # (queued: both look accepted)
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"refused token {z}"):
        fill_bitmasks([(bad, 0), (good, 1)], bitmask)
    assert isinstance(bad.error, RuntimeError) and good.error is None
    good.fill_bitmask(bitmask, 1)
    assert (bitmask[1, a // 32] >> (a % 32)) & 1 and not (bitmask[1, z // 32] >> (z % 32)) & 1


def test_a_grammar_process_that_died_is_an_error_naming_it(tokenizer):
    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [EOS], process=True)
    matcher = manager.compile(StructuredOutputsParams(regex="ab")).matcher()
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    process = manager.backend("xgrammar").process
    process._proc.kill()
    process._proc.wait()
    with pytest.raises(RuntimeError, match=r"grammar process \(structured_outputs_process\) is gone"):
        matcher.fill_bitmask(bitmask, 0)
    with pytest.raises(RuntimeError, match="is gone"):  # and every fill after it
        manager.compile(StructuredOutputsParams(regex="cd")).matcher().fill_bitmask(bitmask, 0)
    manager.shutdown()


def test_the_grammar_process_gives_the_in_process_outputs(llm, checkpoint):
    """The engine with its matchers in a grammar process (structured_outputs_process, the default on GPUs),
    steps pipelined as on a GPU: eight requests under eight grammars give the tokens of the in-process
    matchers, and most masks come from the fills ahead; a grammar process that died fails the constrained
    requests with a message naming it, the others run on."""
    from pagoda import LLM, SamplingParams

    _, params, prompts = eight_grammars()
    expected = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    remote = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=256, block_size=8,
                 max_num_seqs=8, max_num_batched_tokens=64, structured_outputs_process=True)
    remote.engine.enable_step_pipeline()
    try:
        got = [[c.token_ids for c in o.outputs] for o in remote.generate(prompts, params)]
        assert got == expected
        assert remote.engine.mask_ahead.rows_used > 20 and remote.engine.mask_ahead._worker is None
        process = remote.engine.controls.structured_outputs.backend("xgrammar").process
        process._proc.kill()
        process._proc.wait()
        plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outs = remote.generate([[3, 4, 5], [6, 7]], [constrained(StructuredOutputsParams(regex="(ab)+!")), plain])
        assert outs[0].outputs[0].finish_reason == "error" and "grammar process" in outs[0].error
        assert len(outs[1].outputs[0].token_ids) == 4
    finally:
        remote.shutdown()


@pytest.mark.parametrize("ahead_used", [True, False])
def test_masks_over_the_tokenizers_ids_forbid_the_padded_vocabulary(tokenizer, ahead_used):
    """Rows are filled as wide as the library writes them (the tokenizer's ids), ahead or in the step,
    and applied to the model's wider logits with the padded ids forbidden; rows in another order than
    the fill's, a token allowed besides the grammar (the reasoning's opening) and a row whose grammar
    allows nothing (reported, not read from the device) come out as a row-by-row application does."""
    from types import SimpleNamespace

    from pagoda.structured_outputs.mask_ahead import MaskAhead
    from pagoda.structured_outputs.masking import apply_grammar_masks

    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    regex = manager.compile(StructuredOutputsParams(regex="(ab|cd)+!"))
    first, second = regex.matcher(), regex.matcher()

    class Nothing(GrammarMatcher):  # a grammar that allows no token at all
        words = first.words

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0

    done = Nothing(set())
    assert first.accept(tokenizer.convert_tokens_to_ids("a"))
    model_words = first.words + 5  # the model's vocabulary pads 160 ids past the tokenizer's
    ahead = MaskAhead()
    ahead.width = model_words
    if ahead_used:  # filled in the order second, first, done; the step's rows are 3, 0 and 1
        ahead.start([SimpleNamespace(grammar=m, is_finished=False, request_id="r") for m in (second, first, done)])
    opening = 7
    logits = torch.zeros(4, 32 * model_words)
    failed = {}
    blocked = apply_grammar_masks(logits, [(3, first, None), (0, second, opening), (1, done, None)], ahead, failed)
    assert blocked == [1] and not failed and ahead.rows_used == (3 if ahead_used else 0)
    for row, matcher, extra in ((3, first, None), (0, second, opening)):
        want = torch.zeros(1, first.words, dtype=torch.int32)
        matcher.fill_bitmask(want, 0)
        allowed = {t for t in range(32 * first.words) if int(want[0, t // 32]) >> (t % 32) & 1} | {extra} - {None}
        assert {int(t) for t in torch.nonzero(logits[row] == 0).flatten()} == allowed
    assert bool((logits[2] == 0).all())  # a row without a grammar is untouched
    ahead.close()


def test_consecutive_rows_reuse_their_index_and_forbid_the_padded_vocabulary(tokenizer):
    """The usual batch (constrained rows 0..n-1, step after step): the rows' index goes to the device once and
    is reused while the rows stay the same, and the padded ids are forbidden through a slice of rows; each step's
    masks are still its own."""
    from pagoda.structured_outputs import masking

    manager = StructuredOutputManager("xgrammar", tokenizer, VOCAB, [tokenizer.eos_token_id])
    regex = manager.compile(StructuredOutputsParams(regex="(ab|cd)+!"))
    first, second = regex.matcher(), regex.matcher()
    model_words = first.words + 5
    seen = []
    for token in "ab":
        logits = torch.zeros(3, 32 * model_words)
        assert masking.apply_grammar_masks(logits, [(0, first, None), (1, second, None)], None, {}) == []
        seen.append(masking._last_rows[0][1])
        for row, matcher in ((0, first), (1, second)):
            want = torch.zeros(1, first.words, dtype=torch.int32)
            matcher.fill_bitmask(want, 0)
            allowed = {t for t in range(32 * first.words) if int(want[0, t // 32]) >> (t % 32) & 1}
            assert {int(t) for t in torch.nonzero(logits[row] == 0).flatten()} == allowed
        assert bool((logits[2] == 0).all())
        assert first.accept(tokenizer.convert_tokens_to_ids(token))  # the next step's mask differs
    assert seen[0] is seen[1]
    masking.apply_grammar_masks(torch.zeros(3, 32 * model_words), [(2, second, None)], None, {})
    assert masking._last_rows[0][1] is not seen[0] and masking._last_rows[0][1].tolist() == [2]


def test_the_mask_kernel_gets_a_row_count_padded_to_sixteen():
    """xgrammar's CUDA kernel (Triton) compiles a variant per kind of row count: the rows it is given are
    always a multiple of 16, the padding a repeat of a row already masked (masking it twice is a no-op)."""
    from pagoda.structured_outputs.masking import KERNEL_ROWS, _kernel_rows

    for targets in ([5], [3, 0, 1], list(range(16)), list(range(17)), list(range(40, 0, -1))):
        rows = _kernel_rows(targets)
        assert len(rows) % KERNEL_ROWS == 0 and len(rows) - len(targets) < KERNEL_ROWS
        assert rows[:len(targets)] == targets and set(rows) == set(targets)


def test_a_grammar_left_with_no_token_fails_only_its_request(llm, tokenizer):
    """A grammar whose every token the request's own constraints forbid (allowed_token_ids) fails
    that request, read in the same transfer as the batch's tokens; the others finish normally."""
    from pagoda import SamplingParams

    b = tokenizer.convert_tokens_to_ids("b")
    stuck = constrained(StructuredOutputsParams(regex="a+"), allowed_token_ids=[b], temperature=0)
    fine = constrained(StructuredOutputsParams(regex="(ab)+!"), temperature=0)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)  # unconstrained, not argmax
    outs = llm.generate([[3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13]], [stuck, fine, plain, sampled])
    assert outs[0].outputs[0].finish_reason == "error" and "allows no token" in outs[0].error
    assert re.fullmatch(r"(ab)+!", outs[1].outputs[0].text)
    assert len(outs[2].outputs[0].token_ids) == 4
    # the sampled row shares the constrained rows' mask tensor: all its tokens allowed, as alone
    assert outs[3].outputs[0].token_ids == llm.generate([[12, 13]], sampled)[0].outputs[0].token_ids


def test_constrained_steps_run_in_the_step_pipeline(llm, checkpoint, monkeypatch):
    """With the step pipeline (the default on CUDA) constrained and sampled rows no longer send the engine
    back to one step at a time: a step is launched before the previous one's tokens are known and its
    tokens are chosen (masks applied, greedy or sampled) once the grammars took them. The outputs are the
    ones of steps run one at a time. A row whose mask cannot be filled, or whose grammar leaves it no
    token, fails its request only."""
    from pagoda import SamplingParams
    from pagoda.structured_outputs import backends

    schemas, params, prompts = eight_grammars()
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    piped = _llm(checkpoint, pipelined=True)
    pipeline = piped.engine.pipeline
    outs = piped.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert pipeline.launched_ahead > 10 and pipeline.sampled_later > 10
    for i, schema in enumerate(schemas):
        jsonschema.validate(json.loads(outs[i].outputs[0].text), schema)

    # a mask fill that raises for one request ("(xy)+!"), a grammar that forbids every token for another
    x, y, z, w = (piped.get_tokenizer().convert_tokens_to_ids(c) for c in "xyzw")

    def tamper(matcher, bitmask, row):
        def allows(t):
            return bool(int(bitmask[row, t // 32]) >> (t % 32) & 1)

        if matcher.accepted >= 2 and (allows(x) or allows(y)):
            raise RuntimeError("fill failed")
        if matcher.accepted >= 2 and (allows(z) or allows(w)):
            bitmask[row] = 0  # nothing allowed

    real_batch, real_row = backends.fill_bitmasks, backends._XGrammarMatcher.fill_bitmask

    def fill_batch(pairs, bitmask):
        real_batch(pairs, bitmask)
        for matcher, row in pairs:
            tamper(matcher, bitmask, row)

    def fill_row(matcher, bitmask, row):
        real_row(matcher, bitmask, row)
        tamper(matcher, bitmask, row)

    monkeypatch.setattr(backends, "fill_bitmasks", fill_batch)
    monkeypatch.setattr(backends._XGrammarMatcher, "fill_bitmask", fill_row)
    monkeypatch.setattr(piped.engine.runner.sampler, "mask_ahead", None)  # every fill in the step
    fine = constrained(StructuredOutputsParams(regex="(ab)+!"), temperature=0)
    outs = piped.generate([[3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]],
                          [constrained(StructuredOutputsParams(regex="(xy)+!"), temperature=0),
                           constrained(StructuredOutputsParams(regex="(zw)+!")), fine,
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])
    assert outs[0].outputs[0].finish_reason == "error" and "fill failed" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "error" and "allows no token" in outs[1].error
    assert re.fullmatch(r"(ab)+!", outs[2].outputs[0].text) and len(outs[3].outputs[0].token_ids) == 6
    assert piped.get_stats()["kv_blocks_used"] == 0


@pytest.mark.gpu
def test_on_cuda_constrained_steps_run_ahead_with_graphs(checkpoint):
    """On a GPU (graphs, xgrammar's CUDA mask kernel, the step pipeline on by default): the eight grammars
    give the tokens of steps run one at a time, each output inside its grammar."""
    from pagoda import LLM

    schemas, params, prompts = eight_grammars()
    outputs = {}
    for pipelined in (False, True):
        llm = LLM(model=str(checkpoint), device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                  max_num_seqs=8, max_num_batched_tokens=64)
        assert llm.engine.pipeline is not None and llm.engine.runner.graphs is not None
        if not pipelined:
            llm.engine.pipeline = None
        outs = llm.generate(prompts, params)
        outputs[pipelined] = [[c.token_ids for c in o.outputs] for o in outs]
        for i, schema in enumerate(schemas):
            jsonschema.validate(json.loads(outs[i].outputs[0].text), schema)
        if pipelined:
            assert llm.engine.pipeline.sampled_later > 10
            # the matchers in a grammar process (the default on CUDA), its fills ahead page-locked where they lie
            process = llm.engine.controls.structured_outputs.backend("xgrammar").process
            ahead = [rows for turn, rows in process._buffers.items() if turn < 2]
            assert ahead and all(rows.pinned for rows in ahead)
            assert llm.get_stats()["device_wait_seconds"] > 0
    assert outputs[True] == outputs[False]
