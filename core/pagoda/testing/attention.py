"""Attention probabilities of a prompt, captured through the reference backends' debug probe.

``ForwardContext.attention_probe`` is called by the torch reference backends (``torch`` and
``torch_mla``) with ``(layer, seq_index, probs [num_heads, Q, L])`` for every sequence of a
step. ``capture_attention`` runs one prefill of the whole prompt with a probe set and keeps
each attention layer's [num_heads, n, n] map; ``head_statistics`` summarises a map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.errors import ConfigError

LOCAL_WINDOW = 4  # "local share": attention on the query's own token and the 3 before it


@dataclass
class AttentionCapture:
    token_ids: list[int]
    maps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, n, n] float32, causal

    @property
    def num_layers(self) -> int:
        return len(self.maps)

    @property
    def num_heads(self) -> int:
        return next(iter(self.maps.values())).shape[0] if self.maps else 0


def capture_attention(llm, token_ids: list[int]) -> AttentionCapture:
    """Prefill ``token_ids`` once through ``llm``'s paged path and return the attention
    probabilities of every layer (float32, on the CPU). Needs a backend that reports them
    (the reference ``torch``/``torch_mla`` backends do)."""
    from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
    from pagoda.engine.sequence import Sequence
    from pagoda.forward_context import prepared_context, set_forward_context
    from pagoda.sampling_params import SamplingParams

    engine = llm.engine
    runner = engine.runner
    capture = AttentionCapture(list(token_ids))
    n = len(token_ids)

    def probe(layer, seq_index: int, probs: torch.Tensor) -> None:
        # one sequence, prefilled whole: probs is [heads, n, n]
        capture.maps[layer.layer_index] = probs.detach().float().cpu()

    seq = Sequence("attention-map", 0, list(token_ids), SamplingParams(max_tokens=1))
    if not engine.block_manager.allocate_slots(seq, n):
        raise ConfigError(f"the KV cache cannot hold a {n}-token prompt; give it more blocks (num_kv_blocks)")
    try:
        from pagoda.engine.inputs import build_step_inputs
        from pagoda.engine.step_plan import plan_step

        out = SchedulerOutput([ScheduledSeq(seq, n, True)], 0, n)
        inputs = build_step_inputs(plan_step(out), engine.config.block_size, runner.device,
                                   num_groups=runner.kv_layout.num_groups)
        ctx = prepared_context(inputs.meta, runner.backends, token_seq_lens=inputs.token_seq_lens,
                               attention_probe=probe, group_tables=inputs.group_tables)
        with torch.inference_mode(), set_forward_context(ctx):
            runner.model(inputs.input_ids, inputs.positions)
    finally:
        engine.block_manager.free(seq)
    silent = [layer.prefix or str(layer.layer_index) for layer in runner.attn_layers
              if layer.layer_index not in capture.maps]
    if silent:
        names = ", ".join(sorted({b.name for b in runner.backends.values()}))
        raise ConfigError(f"attention backend {names} did not report attention probabilities for layers "
                          f"{', '.join(silent[:4])}{' ...' if len(silent) > 4 else ''}: only the reference backends "
                          f"form full maps; run on the CPU (--device cpu) or with attention_backend: torch")
    return capture


def head_statistics(probs: torch.Tensor) -> dict:
    """Statistics of one head's causal map ``probs`` [n, n] (row q: query q's weights):

    - ``entropy``: mean over queries of -sum p log p (nats);
    - ``normalized_entropy``: that over log(keys the query may see), queries with 2+ keys
      (0: always one key, 1: uniform over all it may see);
    - ``first_token``: mean weight on the first token, queries after the first;
    - ``mean_distance``: mean over queries of the expected distance q - k in tokens;
    - ``local_share``: mean weight on the query's own token and the 3 before it."""
    n = probs.shape[-1]
    p = probs.double()
    logs = torch.where(p > 0, p.log(), torch.zeros_like(p))
    entropy = -(p * logs).sum(-1)  # [n]
    q = torch.arange(n, dtype=torch.float64)
    visible = (q + 1).log()
    normalized = entropy[1:] / visible[1:] if n > 1 else entropy.new_zeros(0)
    distance = q[:, None] - q[None, :]
    local = ((distance >= 0) & (distance < LOCAL_WINDOW)).double()
    return {
        "entropy": float(entropy.mean()),
        "normalized_entropy": float(normalized.mean()) if n > 1 else 0.0,
        "first_token": float(p[1:, 0].mean()) if n > 1 else 1.0,
        "mean_distance": float((p * distance.clamp(min=0)).sum(-1).mean()),
        "local_share": float((p * local).sum(-1).mean()),
    }


def capture_statistics(capture: AttentionCapture, layers: list[int], heads: list[int]) -> list[dict]:
    """One row per (layer, head): {"layer", "head", **head_statistics}."""
    rows = []
    for layer in layers:
        for head in heads:
            rows.append({"layer": layer, "head": head, **head_statistics(capture.maps[layer][head])})
    return rows

