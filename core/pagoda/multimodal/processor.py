"""The engine's preprocessing of a request's images: decode, check the limits, run the model's
image processor, expand each image's placeholder to its token count and compute the prompt's
M-RoPE positions. Pure CPU work on the caller's thread (the server runs it in a worker thread,
never on the engine loop). The front of engines in other processes (``pagoda.distributed.data_parallel``)
processes images itself with ``processor_without_weights``: the replicas only encode them."""

from __future__ import annotations

from typing import Any

from pagoda.errors import RequestError
from pagoda.multimodal.inputs import MultiModalInputs, PlacedImage
from pagoda.multimodal.media import image_hash, open_image, require_pillow

DEFAULT_IMAGE_LIMIT = 8


class MultiModalProcessor:
    def __init__(self, model, model_dir: str | None, config):
        require_pillow()
        self.model = model
        self.placeholder_token_id = int(model.placeholder_token_id)
        self.placeholder_text = model.placeholder_text
        self.image_limit = int((config.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGE_LIMIT))
        self.max_image_pixels = config.max_image_pixels
        self.process_images = model.create_image_processor(model_dir, dict(config.mm_processor_kwargs or {}))

    def images_of(self, multi_modal_data: Any, field: str = "multi_modal_data") -> list[tuple[Any, str]]:
        """(image, the field that names it) of a ``multi_modal_data`` dict."""
        if not isinstance(multi_modal_data, dict):
            raise RequestError("must be a dict such as {'image': PIL.Image or a list of them}", field=field)
        unknown = sorted(set(multi_modal_data) - {"image"})
        if unknown:
            raise RequestError(f"modality {', '.join(map(repr, unknown))} is not supported (this model takes "
                               f"'image')", field=field)
        images = multi_modal_data.get("image")
        if images is None:
            return []
        if not isinstance(images, (list, tuple)):
            return [(images, f"{field}.image")]
        return [(im, f"{field}.image[{i}]") for i, im in enumerate(images)]

    def process(self, prompt_token_ids: list[int], images: list[tuple[Any, str]],
                prompt_field: str = "prompt") -> MultiModalInputs:
        """``images``: (image as PIL/bytes/base64, the request field it came from), in prompt order."""
        if len(images) > self.image_limit:
            raise RequestError(f"{len(images)} images, more than limit_mm_per_prompt image={self.image_limit}",
                               field=images[self.image_limit][1])
        found = sum(1 for t in prompt_token_ids if t == self.placeholder_token_id)
        if found != len(images):
            raise RequestError(f"the prompt holds {found} image placeholders (token id {self.placeholder_token_id}, "
                               f"{self.placeholder_text!r}) for {len(images)} images: write one per image",
                               field=prompt_field)
        pictures = [open_image(data, where, self.max_image_pixels) for data, where in images]
        processed = self.process_images(pictures) if pictures else []
        ids: list[int] = []
        placed: list[PlacedImage] = []
        it = iter(zip(processed, pictures))
        for token in prompt_token_ids:
            if token != self.placeholder_token_id:
                ids.append(token)
                continue
            image, picture = next(it)
            placed.append(PlacedImage(len(ids), image.num_tokens, image_hash(picture), image))
            ids.extend([self.placeholder_token_id] * image.num_tokens)
        mrope = self.model.mrope_positions(ids, [(p.offset, p.image) for p in placed])
        positions, delta = mrope if mrope is not None else (None, 0)
        return MultiModalInputs(ids, placed, positions, delta)


def processor_without_weights(config, source, hf_config) -> MultiModalProcessor | None:
    """The processor of a model loaded elsewhere (engines in other processes), or None for a text-only
    model: its class built on the meta device (no memory, no weights), whose multimodal contract
    (placeholder, image processor, M-RoPE positions) reads only the checkpoint's config."""
    import torch

    from pagoda.interfaces import supports_multimodal
    from pagoda.selection import resolve_model_class

    if config.runner == "pooling":  # (its requests take no images)
        return None
    try:
        cls = resolve_model_class(list(getattr(hf_config, "architectures", None) or []), str(source.path),
                                  model_impl=config.model_impl, hf_config=hf_config)
    except Exception:  # noqa: BLE001 - the engine's own load reports it, with its context
        return None
    if not supports_multimodal(cls):
        return None
    with torch.device("meta"):
        model = cls(hf_config, quant_config=None, prefix="")
    return MultiModalProcessor(model, str(source.path) if source.kind != "gguf" else None, config)
