"""Image processors from transformers, in their PIL implementations (no torchvision needed)."""

from __future__ import annotations

from pathlib import Path

from pagoda.errors import ConfigError


def qwen2_vl_image_processor(model_dir: str | None, vision_config, options: dict):
    """Qwen2-VL / Qwen2.5-VL's image processor: the checkpoint's ``preprocessor_config.json`` when
    there is one, else the vision config's patch and merge sizes with transformers' defaults;
    ``options`` (``mm_processor_kwargs``: min_pixels, max_pixels, ...) override either."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        if model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file():
            return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), **options)
        return Qwen2VLImageProcessorPil(patch_size=vision_config.patch_size,
                                        temporal_patch_size=vision_config.temporal_patch_size,
                                        merge_size=vision_config.spatial_merge_size, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"mm_processor_kwargs {options}: the Qwen2-VL image processor refused them: {exc}") from exc
