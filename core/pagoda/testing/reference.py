"""Tiny random HF checkpoints and transformers reference outputs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch


def make_tiny_checkpoint(model_type: str, directory: str | Path, seed: int = 0, tokenizer: bool = False,
                         randomize_buffers: bool = False, **overrides: Any) -> Path:
    """Build a random ``AutoModelForCausalLM`` from ``AutoConfig.for_model(model_type, ...)``
    and ``save_pretrained`` it (float32 safetensors) into ``directory``.

    ``randomize_buffers``: also draw the saved floating-point buffers from N(0, 0.1) (HF
    initialises some to zeros, e.g. DeepSeek-V3's ``e_score_correction_bias``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    config = AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen_weights(model, randomize_buffers)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        save_byte_tokenizer(directory, config.vocab_size)
    return directory


@torch.no_grad()
def widen_weights(model, randomize_buffers: bool = False) -> None:
    """HF's init leaves many weights tiny; draw them wider so outputs vary: matrices N(0, 0.08), norms
    U(0.8, 1.2), biases N(0, 0.05); with ``randomize_buffers`` also the saved floating-point buffers
    N(0, 0.1) (HF initialises some to zeros, e.g. DeepSeek-V3's ``e_score_correction_bias``)."""
    for name, param in model.named_parameters():
        if param.dim() >= 2 and "norm" not in name:
            param.normal_(0.0, 0.08)
        elif "norm" in name:
            param.uniform_(0.8, 1.2)
        elif "bias" in name:
            param.normal_(0.0, 0.05)
    if randomize_buffers:
        saved = set(model.state_dict())
        for name, buffer in model.named_buffers():
            if name in saved and buffer.is_floating_point() and "inv_freq" not in name:
                buffer.normal_(0.0, 0.1)


def save_byte_tokenizer(directory: Path, vocab_size: int) -> None:
    """A tiny byte-level BPE tokenizer (no merges) that fits any vocab >= 260."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "<pad>": 3}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte tokenizer's {len(vocab)}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    fast.save_pretrained(directory)


def random_prompts(n: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0,
                   low: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _load_hf(directory: str | Path):
    return load_reference_model(directory)


def load_reference_model(directory: str | Path, model_type: str | None = None):
    """The transformers model of a checkpoint, float32, in eval mode.

    ``model_type``: the transformers model type to build it as, for checkpoints whose own
    ``model_type`` transformers does not know (an architecture a plugin brings, computed as
    an existing one computes it); None: the checkpoint's own."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    kwargs = {}
    if model_type is not None:
        import json

        fields = json.loads((Path(directory) / "config.json").read_text())
        fields.pop("model_type", None)
        kwargs["config"] = CONFIG_MAPPING[model_type].from_dict(fields)
    import json

    saved = json.loads((Path(directory) / "config.json").read_text())
    if saved.get("attn_logit_softcapping"):  # transformers' SDPA path drops the soft-cap: its eager path is the math
        kwargs["attn_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    model.eval()
    return model


@torch.no_grad()
def hf_greedy_tokens(directory: str | Path, prompts: list[list[int]], max_new_tokens: int,
                     model=None, stepwise: bool = False) -> list[list[int]]:
    """Greedy continuation of each prompt, one at a time (no padding), by transformers.

    ``stepwise``: instead of ``generate``, one prefill of the prompt then one forward per
    new token over transformers' ``DynamicCache`` with explicit positions, bypassing a
    model's own ``prepare_inputs_for_generation`` (transformers 5.17's Phi-3 drops the cache
    once a sequence grows past ``original_max_position_embeddings`` and from then on feeds
    each new token with no context at all).
    """
    model = model or _load_hf(directory)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        if stepwise:
            outs.append(_stepwise_greedy(model, prompt, max_new_tokens))
            continue
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def set_eos_token(directory: str | Path, token: int) -> None:
    """Make ``token`` the checkpoint's EOS (config.json ``eos_token_id``), so that a test can stop
    greedy sequences where transformers' continuation reaches it."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = token
    path.write_text(json.dumps(config))


def cut_at_stops(continuations: list[list[int]], eos: int, limits: list[int]) -> list[list[int]]:
    """Greedy outputs with stops: each continuation (``hf_greedy_tokens``, EOS ignored) cut at its
    request's ``max_tokens`` and just after the first ``eos``."""
    out = []
    for tokens, limit in zip(continuations, limits):
        tokens = tokens[:limit]
        out.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def _stepwise_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    tokens: list[int] = []
    for step in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        if step + 1 < max_new_tokens:
            position = torch.tensor([[len(prompt) + step]])
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True, position_ids=position)
    return tokens


@torch.no_grad()
def hf_expert_counts(directory: str | Path, sequences: list[list[int]], model=None) -> dict[str, list[int]]:
    """Tokens routed to each expert by transformers' own routers over ``sequences`` (one
    forward each): {router module name (e.g. ``model.layers.1.mlp.gate``): [count per expert]}.

    Every router module of the HF model (a class named ``*TopKRouter``/``*TopkRouter``
    returning (logits, weights, expert indices)) is hooked; each (token, chosen expert) pair
    counts one."""
    model = model or _load_hf(directory)
    counts: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            experts = module.weight.shape[0]

            def record(mod, args, output, name=name, experts=experts):
                ids = output[2].reshape(-1)
                counts[name] = counts.get(name, torch.zeros(experts, dtype=torch.long)) + torch.bincount(
                    ids, minlength=experts)

            hooks.append(module.register_forward_hook(record))
    if not hooks:
        raise ValueError(f"{type(model).__name__} has no *TopKRouter module to count expert choices from")
    try:
        for seq in sequences:
            model(torch.tensor([seq]))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: c.tolist() for name, c in sorted(counts.items())}


@torch.no_grad()
def hf_prompt_logits(directory: str | Path, prompt: list[int], model=None) -> torch.Tensor:
    model = model or _load_hf(directory)
    return model(torch.tensor([prompt])).logits[0].float()
