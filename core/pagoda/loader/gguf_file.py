"""GGUF files: the HF config, tokenizer and chat template from the metadata, and the
weights dequantized at load under their HF names (Llama-family architectures)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from pagoda.errors import ModelLoadError

# GGUF architecture -> HF model_type and architecture class
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# GGUF per-layer tensor name -> HF name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PLAIN_FLOAT_TYPES = ("F32", "F16")
TOKEN_TYPE_CONTROL = 3


def _as_tensor(data: np.ndarray) -> torch.Tensor:
    """A tensor over ``data`` without copying it when it is a view of the mapped file (read-only: the
    loaders only read it; a parameter copies it)."""
    if not data.flags.writeable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
            return torch.from_numpy(data)
    return torch.from_numpy(data)


@functools.lru_cache(maxsize=2)
def open_gguf(path: Path) -> GGUFCheckpoint:
    """Parse a GGUF file once per process (its metadata takes seconds to read)."""
    return GGUFCheckpoint(Path(path))


class GGUFCheckpoint:
    def __init__(self, path: Path):
        from pagoda.loader.gguf_format import read_gguf

        self.path = path
        try:
            self.fields, self.tensors = read_gguf(path)
        except Exception as exc:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported "
                                 f"(supported: {', '.join(ARCHITECTURES)})")

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    @cached_property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def hf_config(self):
        """The model config from the metadata (``gguf_config.ModelConfig``: no transformers import)."""
        from pagoda.loader.gguf_config import ModelConfig, rope_parameters

        model_type, architecture = ARCHITECTURES[self.arch]
        heads = self.arch_field("attention.head_count")
        hidden = self.arch_field("embedding_length")
        tokens = self.fields.get("tokenizer.ggml.tokens", [])
        head_dim = self.arch_field("attention.key_length", hidden // heads)
        rotary = self.arch_field("rope.dimension_count", head_dim)
        scaling = {key: self.arch_field(f"rope.scaling.{key}") for key in ("type", "factor",
                                                                            "original_context_length")}
        values = dict(
            architectures=[architecture],
            vocab_size=self.arch_field("vocab_size", len(tokens)),
            hidden_size=hidden,
            intermediate_size=self.arch_field("feed_forward_length"),
            num_hidden_layers=self.arch_field("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self.arch_field("attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=self.arch_field("context_length", 2048),
            rms_norm_eps=self.arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self.arch_field("rope.freq_base", 10000.0),
            rope_parameters=rope_parameters(self.arch_field("rope.freq_base", 10000.0), scaling),
            partial_rotary_factor=rotary / head_dim if rotary != head_dim else None,
            tie_word_embeddings="output.weight" not in self.tensor_names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            attention_bias=self.arch == "qwen2",
            sliding_window=self.arch_field("attention.sliding_window"),
        )
        return ModelConfig(model_type, **values)

    def tokenizer(self):
        """The tokenizer from the GGUF vocabulary (byte-level BPE, 'gpt2' type), on the ``tokenizers``
        library alone (``gguf_tokenizer.GGUFTokenizer``; its ``hf`` is the transformers one)."""
        from pagoda.loader.gguf_tokenizer import GGUFTokenizer
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"{self.path}: GGUF tokenizer type {kind!r} is not supported (only the "
                                 f"byte-level BPE type 'gpt2'); pass --tokenizer DIR with an HF tokenizer")
        tokens = self.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        types = self.field("tokenizer.ggml.token_type") or []
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        special: dict[str, int | None] = {}
        for key in ("bos", "eos", "unknown", "padding"):
            idx = self.field(f"tokenizer.ggml.{key}_token_id")
            special[{"unknown": "unk", "padding": "pad"}.get(key, key)] = \
                idx if idx is not None and 0 <= idx < len(tokens) else None
        control = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
        named = [tokens[i] for i in special.values() if i is not None]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in dict.fromkeys(named + control)])
        return GGUFTokenizer(tok, tokens, special, self.field("tokenizer.chat_template"),
                             lambda: self._hf_tokenizer(tok, tokens, special, control))

    def _hf_tokenizer(self, tok, tokens, special, control):
        from transformers import PreTrainedTokenizerFast

        def name(key):
            return tokens[special[key]] if special.get(key) is not None else None

        hf = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=name("bos"), eos_token=name("eos"), unk_token=name("unk"),
            pad_token=name("pad"), additional_special_tokens=control, clean_up_tokenization_spaces=False,
        )
        template = self.field("tokenizer.chat_template")
        if template:
            hf.chat_template = template
        return hf

    def _reverse_permute(self, w: np.ndarray, heads: int) -> np.ndarray:
        """llama.cpp stores Llama's q/k rows interleaved per rotary pair; undo it."""
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def _dequantized(self, t) -> np.ndarray:
        import gguf

        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r} of type {t.tensor_type.name} could "
                                 f"not be dequantized: {exc}") from exc
        return np.asarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])

    def weights(self, sources: dict[str, str], keeps_raw: Callable[[str, str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, dequantized to float32, except where ``keeps_raw(name,
        GGML type name)`` says the quantization method reads the GGUF blocks itself: then the
        tensor's raw block rows (uint8 [rows, bytes per row])."""
        heads = self.arch_field("attention.head_count")
        kv_heads = self.arch_field("attention.head_count_kv", heads)
        for t in self.tensors:
            stem, _, kind = t.name.rpartition(".")
            if stem.startswith("blk."):
                _, layer, base = stem.split(".", 2)
                if base not in LAYER_TENSORS:
                    raise ModelLoadError(f"{self.path}: unexpected GGUF tensor {t.name!r}")
                name = f"model.layers.{layer}.{LAYER_TENSORS[base]}.{kind}"
            elif stem in GLOBAL_TENSORS:
                name = f"{GLOBAL_TENSORS[stem]}.{kind}"
            else:
                continue  # e.g. rope_freqs: derived from the config instead
            raw = keeps_raw is not None and keeps_raw(name, t.tensor_type.name)
            if raw:
                data = t.data  # uint8 [rows, bytes]: rows are output channels, as after dequantization
            elif t.tensor_type.name in PLAIN_FLOAT_TYPES:
                data = t.data
            else:
                data = self._dequantized(t)
            if self.arch == "llama" and stem.startswith("blk.") and base in ("attn_q", "attn_k"):
                data = self._reverse_permute(data, heads if base == "attn_q" else kv_heads)
            sources[name] = self.path.name
            tensor = _as_tensor(data)
            if data is t.data and not data.flags.writeable:
                tensor._gguf_mapped = True  # a view of the mapped file (release_pages may drop its pages)
            # the file's type (blocks when uint8, else already float), read by the gguf quantization method
            tensor.ggml_type = t.tensor_type.name
            yield name, tensor
