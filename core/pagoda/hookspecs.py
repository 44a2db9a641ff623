"""The plugin contract: nine collect-all hooks.

Every hook is called once per process, when the plugin manager is first needed
(``pagoda.plugins.get_plugin_manager()``), in no particular order. Each receives a
``register`` callable and calls it zero or more times. The core stores what is
registered in a registry (``pagoda.registry``) that rejects a name registered twice
with an error naming both distributions, so the order of hook calls never matters.

Heavy imports (torch kernels, triton, vendor extensions) must happen lazily inside the
registered objects or behind ``"module:attr"`` strings, never at plugin import: discovery
stays fast and a missing device library cannot break unrelated plugins.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT = "pagoda"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_platforms(register: Callable) -> None:
    """Register device platforms.

    ``register(platform)`` takes an instance of ``pagoda.interfaces.Platform`` (its
    ``name`` is the registry key, e.g. ``"cuda"``). ``device: auto`` selects the
    available platform of highest ``priority``; an explicitly requested platform that
    is unavailable is an error carrying ``platform.unavailable_reason()``.
    """


@hookspec
def register_attention_backends(register: Callable) -> None:
    """Register attention backends.

    ``register(backend)`` takes an instance of ``pagoda.interfaces.AttentionBackend``.
    ``attention_backend: auto`` selects, among backends whose ``supports(...)`` returns
    no reason for the platform, dtype, head size and attention kind (``"mha"`` or
    ``"mla"``), the one with the highest ``priority``.
    """


@hookspec
def register_models(register: Callable) -> None:
    """Register model architectures.

    ``register(architecture, model)`` maps an HF architecture name as found in a
    checkpoint's ``config.json`` ``architectures`` list (e.g. ``"LlamaForCausalLM"``) to a
    model class or a lazy ``"module:Class"`` string, imported only when selected.
    """


@hookspec
def register_quantizers(register: Callable) -> None:
    """Register quantization methods.

    ``register(quantizer)`` takes an instance of ``pagoda.interfaces.Quantizer``. Its
    ``name`` matches a checkpoint's ``quantization_config.quant_method`` or the user's
    ``quantization:`` setting; it builds a ``QuantConfig`` that hands each layer its
    ``QuantMethod``.
    """


@hookspec
def register_allocators(register: Callable) -> None:
    """Register KV cache allocators.

    ``register(allocator)`` takes an instance of ``pagoda.interfaces.KVAllocator``. For
    the selected platform the allocator of highest ``priority`` among those listing that
    platform sizes and allocates the KV cache.
    """


@hookspec
def register_kernels(register: Callable) -> None:
    """Register named kernel ops.

    ``register(op, platform, impl, priority=0)``: ``op`` is a name such as
    ``"rms_norm"`` (the signatures are documented in ``pagoda.kernels.reference``),
    ``platform`` a platform name or ``"*"`` for any, ``impl`` a callable or a lazy
    ``"module:function"`` string. Per platform and op the highest priority wins; the
    core's torch reference (priority 0, platform ``"*"``) is the floor.
    """


@hookspec
def register_tool_parsers(register: Callable) -> None:
    """Register tool-call parsers.

    ``register(name, parser)`` maps a name (the value of ``tool_call_parser`` /
    ``--tool-call-parser``, e.g. ``"hermes"``) to a subclass of
    ``pagoda.parsers.ToolParser`` or a lazy ``"module:Class"`` string. The server makes one
    instance per request, ``Parser(tokenizer, tools)``, and turns the model's output into
    OpenAI tool calls with ``extract(text)`` or, streaming, ``stream().feed(delta, done)``
    (docs/parsers.md).
    """


@hookspec
def register_reasoning_parsers(register: Callable) -> None:
    """Register reasoning parsers.

    ``register(name, parser)`` maps a name (the value of ``reasoning_parser`` /
    ``--reasoning-parser``, e.g. ``"qwen3"``) to a subclass of
    ``pagoda.parsers.ReasoningParser`` or a lazy ``"module:Class"`` string, made per request
    as ``Parser(tokenizer)``; it splits the output into reasoning and content and tells the
    engine when the reasoning has ended (docs/parsers.md).
    """


@hookspec
def register_logits_processors(register: Callable) -> None:
    """Register logits processors.

    ``register(name, processor)`` maps a name (an entry of ``logits_processors`` /
    ``--logits-processors``) to a subclass of ``pagoda.interfaces.LogitsProcessor`` or a
    lazy ``"module:Class"`` string. The engine constructs each selected processor once,
    ``Processor(vocab_size, tokenizer)``, and calls it on every request's row of logits
    before sampling: ``processor(output_token_ids, logits) -> logits``.
    """
