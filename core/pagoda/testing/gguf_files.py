"""Tiny GGUF files for tests, written with the ``gguf`` package: random weights in any block type.

``random_blocks`` makes valid block bytes of a type (random codes, small random float16 scales) so
that K-quants, which the gguf package cannot quantize, can be written too; ``write_tiny_llama_gguf``
writes a Llama-architecture file (llama.cpp's tensor names and metadata keys) with a byte-level BPE
tokenizer of 256 byte tokens, a few merges and the chat-template key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# where each type keeps its float16 scale fields (byte offsets in a block)
_SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_blocks(rows: int, cols: int, ggml_type: str, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """uint8 [rows, bytes per row] of ``ggml_type`` blocks whose weights are of order ``scale``."""
    import gguf

    kind = gguf.GGMLQuantizationType[ggml_type]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # weight range of one block in units of d (codes times the largest sub-block scale for K-quants)
    levels = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 32, "Q5_1": 32, "Q8_0": 256, "Q4_K": 16 * 63, "Q5_K": 32 * 63,
              "Q6_K": 64 * 127, "Q2_K": 4 * 15, "Q3_K": 8 * 31}[ggml_type]
    d = rng.uniform(0.5, 1.0, raw.shape[:2]) * 2 * scale / levels
    fields = _SCALE_FIELDS[ggml_type]
    raw[..., fields[0]:fields[0] + 2] = d.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if len(fields) > 1:  # a minimum (m, or dmin times 6-bit mins) that centres the weights near 0
        second = -d * levels / 2 if ggml_type.endswith("_1") else d * levels / 2 / 32
        raw[..., fields[1]:fields[1] + 2] = second.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's byte-to-unicode alphabet as 256 tokens, plus a few merges and special tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = [chr(c) for _, c in sorted(zip(bs, cs))]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|im_start|>", "<|im_end|>"]
    return tokens, merges


def write_tiny_llama_gguf(path: str | Path, types: dict[str, str], seed: int = 0, hidden: int = 256,
                          intermediate: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          tied: bool = False, default_type: str = "Q8_0") -> Path:
    """A Llama GGUF file; ``types`` maps llama.cpp tensor stems (``token_embd``, ``output``,
    ``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``, ``ffn_down``) to a
    block type (F32/F16 allowed), others get ``default_type``."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = _byte_level_vocab()
    vocab = len(tokens)
    vocab_rows = -(-vocab // 32) * 32
    tokens += [f"<unused{i}>" for i in range(vocab_rows - vocab)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab_rows)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * (len(tokens) - 2 - (vocab_rows - vocab)) + [3, 3] + [5] * (vocab_rows - vocab))
    writer.add_bos_token_id(len(tokens) - (vocab_rows - vocab) - 2)
    writer.add_eos_token_id(len(tokens) - (vocab_rows - vocab) - 1)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    head_dim = hidden // heads

    def add(name: str, stem: str, rows: int, cols: int, scale: float = 0.05) -> None:
        kind = types.get(stem, default_type)
        if kind in ("F32", "F16"):
            data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32 if kind == "F32" else np.float16)
            writer.add_tensor(name, data)
            return
        raw = random_blocks(rows, cols, kind, rng, scale)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", "token_embd", vocab_rows, hidden, 1.0)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(f"blk.{i}.attn_q.weight", "attn_q", heads * head_dim, hidden, 0.2)
        add(f"blk.{i}.attn_k.weight", "attn_k", kv_heads * head_dim, hidden, 0.2)
        add(f"blk.{i}.attn_v.weight", "attn_v", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", "attn_output", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", "ffn_gate", intermediate, hidden)
        add(f"blk.{i}.ffn_up.weight", "ffn_up", intermediate, hidden)
        add(f"blk.{i}.ffn_down.weight", "ffn_down", hidden, intermediate)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not tied:
        add("output.weight", "output", vocab_rows, hidden, 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


# HF name (after "model.layers.N.") -> llama.cpp's tensor stem, for write_gguf_from_checkpoint
_HF_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_HF_TO_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen2_moe": "qwen2moe",
                    "qwen3_moe": "qwen3moe"}


def write_gguf_from_checkpoint(model_dir: str | Path, path: str | Path, ggml_type: str = "F32") -> Path:
    """A GGUF file of a (tiny) HF checkpoint, in llama.cpp's layout for its architecture (tensor names,
    stacked experts, metadata keys; Llama's q/k rows permuted as llama.cpp's converter does): 2-D weights
    in ``ggml_type`` (F32, F16, or a type the gguf package quantizes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), norms
    and biases in F32; a byte-level BPE vocabulary of the checkpoint's size."""
    import json

    import gguf
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    arch = _HF_TO_GGUF_ARCH[config["model_type"]]
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.get("intermediate_size", 0))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    tokens, merges = _byte_level_vocab()
    specials = len(tokens) - 2
    tokens += [f"<unused{i}>" for i in range(config["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * specials + [3, 3] + [5] * (len(tokens) - specials - 2))
    writer.add_bos_token_id(specials)
    writer.add_eos_token_id(specials + 1)
    writer.add_pad_token_id(specials + 1)

    def add(name: str, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.float32)
        if data.ndim < 2 or ggml_type == "F32":
            writer.add_tensor(name, data)
        elif ggml_type == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[ggml_type]
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_shape=gguf.quants.quant_shape_to_byte_shape(
                data.shape, kind), raw_dtype=kind)

    def permute(w: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's interleaving of Llama's rotary pairs
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors and not config.get("tie_word_embeddings"):
        add("output.weight", tensors["lm_head.weight"])
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, data in tensors.items():
        if not name.startswith("model.layers."):
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module.startswith("mlp.experts."):
            _, _, e, proj = module.split(".")
            experts.setdefault((layer, proj), {})[int(e)] = data
            continue
        stem = _HF_LAYER_TO_GGUF[module]
        if arch == "llama" and stem in ("attn_q", "attn_k") and kind == "weight":
            data = permute(data, heads if stem == "attn_q" else kv_heads)
        if stem == "ffn_gate_inp_shexp":
            data = data.reshape(-1)
        add(f"blk.{layer}.{stem}.{kind}", data)
    for (layer, proj), per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in sorted(per_expert)])  # [experts, rows, cols]
        add(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
