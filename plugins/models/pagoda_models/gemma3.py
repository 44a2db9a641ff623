"""Gemma 3 (text, ``Gemma3ForCausalLM``, model type ``gemma3_text``): Gemma 2's layers with a
(1 + w) RMSNorm on every query and key head before rotary, five sliding-window layers for each
global one (``layer_types``), a rope per layer type (local base 10k, global 1M, the global one
possibly linearly scaled) and, by default, no soft-capping.
"""

from __future__ import annotations

from pagoda_models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    qk_norm = True


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    FEATURES = ("five sliding-window layers per global one (layer_types; window layers keep only their window's KV "
                "blocks), a rope per layer type (local and "
                "global theta, scaled global rope), (1 + w) RMSNorm on each query and key head, "
                "query_pre_attn_scalar, pre/post (1 + w) norms, sqrt(hidden)-scaled embeddings, optional "
                "soft-capping, tied embeddings")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill, preemption and prefix caching; "
              "prompts longer than the window, linear-scaled global rope "
              "(plugins/models/tests/test_models_gemma.py); Triton path under the interpreter, also through "
              "decode graphs (plugins/cuda/tests); KV blocks held per sequence (tests/test_kv_groups.py)")
    decoder_layer = Gemma3DecoderLayer
