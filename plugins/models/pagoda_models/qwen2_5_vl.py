"""Qwen2.5-VL: a ViT with windowed and full-attention blocks, whose merged patches become tokens
of a Qwen2 language model with multimodal rotary positions (M-RoPE)."""

from __future__ import annotations

import numpy as np
import torch
from pagoda.interfaces import ImageInput, SupportsMultiModal
from pagoda.layers import ParallelLMHead, RMSNorm, rope_parameters_of
from pagoda.layers.mrope import MRotaryEmbedding
from pagoda.layers.vision import PatchEmbed, PatchMerger, VisionAttention, VisionRotary2D
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn

from pagoda_models.llama import LlamaMLP, LlamaModel, head_dim_of


class VisionBlock(nn.Module):
    def __init__(self, vc, prefix: str):
        super().__init__()
        self.norm1 = RMSNorm(vc.hidden_size, 1e-6)
        self.norm2 = RMSNorm(vc.hidden_size, 1e-6)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads, prefix=f"{prefix}.attn")
        self.mlp = LlamaMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act, True, None, f"{prefix}.mlp")

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


def window_plan(grids: list[tuple[int, int, int]], merge: int, window: int):
    """For patches packed image after image (each image's patches grouped by merged cell):
    (order of merged cells that puts each attention window's cells together [cells],
    window boundaries in patches, image-frame boundaries in patches, (row, col) of each patch [S, 2])."""
    order, cu_window, cu_full, hw = [], [0], [0], []
    unit, base = merge * merge, 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        cells = np.arange(gh * gw).reshape(gh, gw)
        inner_r, inner_c = np.divmod(np.arange(unit), merge)
        rows = (np.repeat(np.arange(gh * gw) // gw, unit) * merge + np.tile(inner_r, gh * gw))
        cols = (np.repeat(np.arange(gh * gw) % gw, unit) * merge + np.tile(inner_c, gh * gw))
        for frame in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    part = cells[r:r + window, c:c + window].reshape(-1) + base + frame * gh * gw
                    order.append(part)
                    cu_window.append(cu_window[-1] + part.size * unit)
            cu_full.append(cu_full[-1] + gh * gw * unit)
            hw.append(np.stack([rows, cols], axis=-1))
        base += t * gh * gw
    return np.concatenate(order), cu_window, cu_full, np.concatenate(hw)


class VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge, self.patch = vc.spatial_merge_size, vc.patch_size
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size  # in merged cells
        self.full_blocks = set(vc.fullatt_block_indexes)
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        self.patch_embed = PatchEmbed(patch_dim, vc.hidden_size)
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.rotary = VisionRotary2D(vc.hidden_size // vc.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(vc, f"visual.blocks.{i}") for i in range(vc.depth))
        self.merger = PatchMerger(vc.out_hidden_size, vc.hidden_size, vc.spatial_merge_size, prefix="visual.merger")

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [S, patch_dim] of the images in ``grids`` -> [S / merge**2, out_hidden] embeddings."""
        unit = self.merge ** 2
        order, cu_window, cu_full, hw = window_plan(grids, self.merge, self.window)
        order_t = torch.from_numpy(order).to(pixels.device)
        x = self.patch_embed(pixels)
        s = x.shape[0]
        x = x.view(s // unit, unit, -1)[order_t].reshape(s, -1)  # windows contiguous
        cos, sin = self.rotary(torch.from_numpy(hw).to(pixels.device))
        cos = cos.view(s // unit, unit, -1)[order_t].reshape(s, -1)
        sin = sin.view(s // unit, unit, -1)[order_t].reshape(s, -1)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in self.full_blocks else cu_window, cos, sin)
        return self.merger(x)[torch.argsort(order_t)]


class Qwen2_5_VLForConditionalGeneration(nn.Module, SupportsMultiModal):
    TESTED = ("greedy tokens against transformers for one image, two images and text only, batched with "
              "chunked prefill through an image and preemption (tests/test_multimodal.py)")
    supports_graphs = False  # 3-D positions and image rows are per step: eager

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        text, vc = config.get_text_config(), config.vision_config
        self.placeholder_token_id = config.image_token_id
        self.placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"
        self.merge = vc.spatial_merge_size
        self.visual = VisionTower(vc)
        self.model = LlamaModel(text, quant_config, "model", qkv_bias=True, o_bias=False, qk_norm=False)
        params = rope_parameters_of(text)
        section = params.get("mrope_section") or [16, 24, 24]
        hd = head_dim_of(text)
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = MRotaryEmbedding(hd, text.max_position_embeddings,
                                                          float(params.get("rope_theta", 1e6)), section)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, prefix="lm_head")
        self.tied = bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    # ------------------------------------------------------------------ the multimodal contract
    def create_image_processor(self, model_dir, options):
        from pagoda.multimodal.hf_processor import qwen2_vl_image_processor

        processor = qwen2_vl_image_processor(model_dir, self.config.vision_config, options)
        unit = self.merge ** 2

        def process(images) -> list[ImageInput]:
            found = []
            for image in images:
                out = processor(images=[image], return_tensors="pt")
                grid = tuple(int(g) for g in out["image_grid_thw"][0])
                found.append(ImageInput(out["pixel_values"], grid, grid[0] * grid[1] * grid[2] // unit))
            return found

        return process

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        w = self.visual.patch_embed.proj.weight
        pixels = torch.cat([im.pixel_values for im in images]).to(w.device, w.dtype)
        embeds = self.visual(pixels, [im.grid for im in images])
        return list(embeds.split([im.num_tokens for im in images]))

    def mrope_positions(self, token_ids, placements):
        chunks, cur, prev = [], 0, 0
        for offset, image in placements:
            n = offset - prev
            chunks.append(np.broadcast_to(np.arange(cur, cur + n), (3, n)))
            cur += n
            t, gh, gw = image.grid[0], image.grid[1] // self.merge, image.grid[2] // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            chunks.append(np.stack([tt.ravel() + cur, hh.ravel() + cur, ww.ravel() + cur]))
            cur += max(gh, gw)
            prev = offset + image.num_tokens
        n = len(token_ids) - prev
        chunks.append(np.broadcast_to(np.arange(cur, cur + n), (3, n)))
        positions = np.concatenate(chunks, axis=1).astype(np.int64)
        return positions, int(positions.max()) + 1 - len(token_ids)

    # ------------------------------------------------------------------ the usual model methods
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, image_embeds=None) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            rows, embeds = image_embeds
            hidden = hidden.index_copy(0, rows, embeds.to(hidden.dtype))
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights) -> set[str]:
        def rename(name: str) -> str:  # transformers >= 4.52 nests both halves under model.
            if name.startswith("model.visual."):
                return name[len("model."):]
            if name.startswith("model.language_model."):
                return "model." + name[len("model.language_model."):]
            return name

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight")

        return load_by_name(self, weights, LLAMA_STACKED, skip=skip, rename=rename)
