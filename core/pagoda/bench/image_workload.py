"""The image workload of ``pagoda bench throughput`` (vision-language models): every prompt carries
``--images-per-prompt`` random images of ``--image-size`` (fresh pixels each run, so neither the
prefix cache nor the encoder cache helps) followed by ``--input-len`` random text tokens."""

from __future__ import annotations

from pagoda.errors import ConfigError


def add_image_args(p) -> None:
    p.add_argument("--images-per-prompt", type=int, default=0, help="random images in every prompt (a "
                   "vision-language model, e.g. --shape qwen2.5-vl-3b); 0: text only")
    p.add_argument("--image-size", default="448x448", metavar="WxH", help="size of the random images "
                   "(default 448x448)")


def image_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--image-size {text!r} must be WIDTHxHEIGHT, e.g. 448x448") from None
    if w < 1 or h < 1:
        raise ConfigError(f"--image-size {text!r}: both sides must be at least 1 pixel")
    return w, h


def image_tokens_bound(size: str) -> int:
    """At most how many tokens one image of ``size`` takes (the context the workload needs): Qwen2-VL's
    processor rounds each side to a multiple of 28 pixels, one token per 28x28 (at least 4), and the
    vision start/end tokens around them."""
    w, h = image_size(size)
    return max(4, -(-w // 28) * -(-h // 28)) + 2


def image_prompts(engine, token_prompts: list[list[int]], images_per_prompt: int, size: str, seed: int) -> list[dict]:
    """The token prompts with ``images_per_prompt`` placeholders and random images in front."""
    import numpy as np
    from PIL import Image

    proc = engine.mm_processor
    if proc is None:
        arch = ", ".join(getattr(engine.hf_config, "architectures", None) or ["?"])
        raise ConfigError(f"--images-per-prompt: this model ({arch}) is text-only: it takes no images")
    w, h = image_size(size)
    rng = np.random.default_rng(seed)
    out = []
    for tokens in token_prompts:
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(images_per_prompt)]
        placeholder = proc.placeholder_token_id
        text = [t - 1 if t == placeholder else t for t in tokens]  # a random token is never a placeholder
        out.append({"prompt_token_ids": [placeholder] * images_per_prompt + text,
                    "multi_modal_data": {"image": images}})
    return out
