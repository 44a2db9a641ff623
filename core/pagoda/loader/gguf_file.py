"""GGUF files: the HF config, tokenizer and chat template from the metadata, and the
weights under their HF names (llama.cpp's architectures llama, mistral, qwen2, qwen3, phi3, qwen2moe,
qwen3moe). A MoE file's stacked expert tensors [experts, rows, cols] arrive one expert at a time."""

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
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# GGUF per-layer tensor name -> HF name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # MoE: the router, the shared expert and its sigmoid gate (Qwen2-MoE)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Phi-3's fused tensors (llama.cpp keeps HF's qkv_proj and gate_up_proj), split by rows into HF's separate
# names: row blocks are whole output channels, so raw quantized rows split the same way
FUSED_ROWS = {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}
# stacked experts [experts, rows, cols] -> model.layers.N.mlp.experts.E.<proj>
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
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
            attention_bias="blk.0.attn_q.bias" in self.tensor_names,
            sliding_window=self.arch_field("attention.sliding_window"),
        )
        if model_type == "qwen2_moe":
            values["qkv_bias"] = values["attention_bias"]
        if self.arch_field("expert_count"):
            values.update(
                num_experts=self.arch_field("expert_count"),
                num_local_experts=self.arch_field("expert_count"),  # (transformers 5's name for it)
                num_experts_per_tok=self.arch_field("expert_used_count"),
                moe_intermediate_size=self.arch_field("expert_feed_forward_length"),
                shared_expert_intermediate_size=self.arch_field("expert_shared_feed_forward_length", 0),
                # llama.cpp renormalises the chosen experts' weights for qwen3moe, not for qwen2moe
                norm_topk_prob=self.arch == "qwen3moe",
            )
        if self.arch == "phi3":
            values.update(self._phi3_rope(values["rope_theta"], head_dim, values["max_position_embeddings"]))
        return ModelConfig(model_type, **values)

    def _phi3_rope(self, theta: float, head_dim: int, context: int) -> dict:
        """Phi-3's LongRoPE (the 128k models): the per-dimension factors are the tensors
        ``rope_factors_long`` / ``rope_factors_short``, the original context a metadata key."""
        tensors = {t.name: t for t in self.tensors}
        long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
        original = self.arch_field("rope.scaling.original_context_length")
        if long is None or short is None:
            return {"original_max_position_embeddings": original or context}
        return {"original_max_position_embeddings": original,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": theta,
                                    "long_factor": [float(x) for x in np.asarray(long.data).reshape(-1)],
                                    "short_factor": [float(x) for x in np.asarray(short.data).reshape(-1)],
                                    "original_max_position_embeddings": original}}

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
        head_dim = self.arch_field("attention.key_length", self.arch_field("embedding_length") // heads)
        fused_sizes = {"attn_qkv": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)}
        for t in self.tensors:
            stem, _, kind = t.name.rpartition(".")
            if stem.startswith("blk."):
                _, layer, base = stem.split(".", 2)
                if base in EXPERT_TENSORS:
                    yield from self._experts(t, f"model.layers.{layer}.mlp.experts", EXPERT_TENSORS[base], kind,
                                             sources)
                    continue
                if self.arch == "phi3" and base in FUSED_ROWS:
                    yield from self._split_rows(t, layer, base, kind, fused_sizes.get(base), sources, keeps_raw)
                    continue
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
            if stem.startswith("blk.") and base == "ffn_gate_inp_shexp" and data.ndim == 1:
                data = data.reshape(1, -1)  # HF's shared_expert_gate is a [1, hidden] linear
            sources[name] = self.path.name
            tensor = _as_tensor(data)
            if data is t.data and not data.flags.writeable:
                tensor._gguf_mapped = True  # a view of the mapped file (release_pages may drop its pages)
            # the file's type (blocks when uint8, else already float), read by the gguf quantization method
            tensor.ggml_type = t.tensor_type.name
            yield name, tensor

    def _experts(self, t, prefix: str, proj: str, kind: str, sources: dict[str, str]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """One stacked expert tensor [experts, rows, cols] as each expert's HF weight (float32: the
        experts' computation takes float weights; their blocks are not kept)."""
        data = t.data if t.tensor_type.name in PLAIN_FLOAT_TYPES else self._dequantized(t)
        data = np.asarray(data).reshape([int(d) for d in reversed(t.shape)])
        for e in range(data.shape[0]):
            name = f"{prefix}.{e}.{proj}.{kind}"
            sources[name] = self.path.name
            tensor = torch.from_numpy(np.array(data[e], dtype=np.float32))
            tensor.ggml_type = "F32"
            yield name, tensor

    def _split_rows(self, t, layer: str, base: str, kind: str, sizes: tuple[int, ...] | None,
                    sources: dict[str, str], keeps_raw) -> Iterator[tuple[str, torch.Tensor]]:
        """A fused tensor as its HF pieces (rows: q, k, v by the head counts; gate and up in halves)."""
        names = [f"model.layers.{layer}.{piece}.{kind}" for piece in FUSED_ROWS[base]]
        raw = keeps_raw is not None and all(keeps_raw(name, t.tensor_type.name) for name in names)
        data = t.data if raw or t.tensor_type.name in PLAIN_FLOAT_TYPES else self._dequantized(t)
        rows = data.shape[0]
        sizes = sizes or (rows // 2, rows // 2)
        if sum(sizes) != rows:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r} has {rows} rows, not the {sum(sizes)} its "
                                 f"metadata's head counts imply")
        start = 0
        for name, size in zip(names, sizes):
            piece = np.ascontiguousarray(data[start:start + size])
            start += size
            sources[name] = self.path.name
            tensor = _as_tensor(piece)
            tensor.ggml_type = t.tensor_type.name if raw or t.tensor_type.name in PLAIN_FLOAT_TYPES else "F32"
            yield name, tensor
