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
