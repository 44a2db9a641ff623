"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen2-MoE's sparse layers without a shared
expert, with RMSNorm on each query and key head before rotary (as Qwen3), an explicit
``head_dim``, and attention biases only when ``attention_bias`` is set."""

from __future__ import annotations

from pagoda_models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    FEATURES = ("softmax top-k routing (norm_topk_prob), no shared expert, q/k RMSNorm per head, explicit "
                "head_dim, decoder_sparse_step, mlp_only_layers; experts via fused_moe with per-expert load counts")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill and preemption; norm_topk_prob, "
              "checkpoints with stacked expert tensors; expert counts vs the HF router's choices "
              "(plugins/models/tests/test_models_moe.py)")
    qk_norm = True

    def attention_biases(self, config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias
