"""Tiny Qwen2.5-VL checkpoints (random weights, byte tokenizer with the vision tokens) and
random images, for tests and benchmarks of multimodal serving."""

from __future__ import annotations

from pathlib import Path

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")

def save_vision_tokenizer(directory: Path, vocab_size: int) -> dict[str, int]:
    """The byte tokenizer plus the vision special tokens; returns their ids."""
    from transformers import AutoTokenizer

    from pagoda.testing.reference import save_byte_tokenizer

    save_byte_tokenizer(directory, vocab_size)
    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    return {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}


def make_tiny_qwen2_5_vl(directory: str | Path, seed: int = 0, window_size: int = 56, max_pixels: int = 28 * 28 * 64,
                         tie_word_embeddings: bool = False):
    """Save a tiny Qwen2.5-VL (2 text layers, 2 vision blocks: one windowed, one full) with its
    image processor config and a tokenizer; returns the transformers model (float32, eval)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = save_vision_tokenizer(directory, 320)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=tie_word_embeddings),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, window_size=window_size, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger random weights: greedy tokens that depend on the image
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
    model.save_pretrained(str(directory))
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels).save_pretrained(str(directory))
    return model


def random_image(width: int, height: int, seed: int = 0):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_greedy(model, directory: str | Path, token_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt whose image placeholders (one token each) are
    expanded here as the processor says, with EOS ignored."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = model.config
    kwargs = {}
    ids = list(token_ids)
    if images:
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(directory))
        out = processor(images=list(images), return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // cfg.vision_config.spatial_merge_size ** 2).tolist())
        ids = [t for tok in token_ids for t in ([tok] * next(counts) if tok == cfg.image_token_id else [tok])]
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    inp = torch.tensor([ids])
    kwargs["mm_token_type_ids"] = (inp == cfg.image_token_id).int()
    with torch.no_grad():
        generated = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return generated[0, inp.shape[1]:].tolist()
