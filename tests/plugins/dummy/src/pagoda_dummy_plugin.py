"""A third-party pagoda plugin used by the plugin-contract tests: one object per hook."""

from pagoda import hookimpl
from pagoda.interfaces import AttentionBackend, KVAllocator, LogitsProcessor, Platform, Quantizer
from pagoda.parsers import ReasoningParser, ToolCall, ToolCallResult, ToolParser


class DummyPlatform(Platform):
    name = "dummy"
    device_type = "dummy"
    priority = 50

    def unavailable_reason(self):
        return "the dummy accelerator library 'dummylib' is not installed"


class DummyBackend(AttentionBackend):
    name = "dummy_attention"
    platforms = ("dummy",)


class DummyAllocator(KVAllocator):
    name = "dummy_allocator"
    platforms = ("dummy",)


class DummyQuantizer(Quantizer):
    name = "dummy_quant"


class LineToolParser(ToolParser):
    """Lines 'CALL name {json}' are calls; implements only extract() (streams by buffering)."""

    def extract(self, text):
        calls, content = [], []
        for line in text.splitlines(keepends=True):
            if line.startswith("CALL "):
                name, _, args = line[5:].strip().partition(" ")
                calls.append(ToolCall(self.make_id(len(calls)), name, args or "{}"))
            else:
                content.append(line)
        return ToolCallResult("".join(content) or None, calls)


class BangReasoningParser(ReasoningParser):
    """Reasoning is everything before the first '!!'."""

    def extract(self, text, initial=None):
        reasoning, sep, content = text.partition("!!")
        return (reasoning or None, content or None) if sep else (None, text or None)


class BanTokenProcessor(LogitsProcessor):
    """Forbids token 3 (a real processor would take its setting from elsewhere)."""

    def __call__(self, output_token_ids, logits):
        logits[3] = float("-inf")
        return logits


def scaled_rms_norm(x, weight, eps):
    raise RuntimeError("only for the dummy platform")


@hookimpl
def register_platforms(register):
    register(DummyPlatform())


@hookimpl
def register_attention_backends(register):
    register(DummyBackend())


@hookimpl
def register_models(register):
    register("DummyForCausalLM", "pagoda_dummy_plugin:DummyModel")


@hookimpl
def register_quantizers(register):
    register(DummyQuantizer())


@hookimpl
def register_allocators(register):
    register(DummyAllocator())


@hookimpl
def register_kernels(register):
    register("rms_norm", "dummy", scaled_rms_norm, priority=5)


@hookimpl
def register_tool_parsers(register):
    register("dummy_lines", LineToolParser)
    register("dummy_missing", "pagoda_dummy_plugin:NoSuchParser")


@hookimpl
def register_reasoning_parsers(register):
    register("dummy_bang", "pagoda_dummy_plugin:BangReasoningParser")


@hookimpl
def register_logits_processors(register):
    register("dummy_ban", BanTokenProcessor)
