"""Pipeline parallelism: the layers split into stages, activations sent from stage to stage.

Ranks: ``pipeline_parallel_size`` stages x ``tensor_parallel_size`` ranks each; global rank
``stage * tp + tp_rank``; rank 0 (stage 0) schedules and samples as under tensor parallelism.
Each stage builds only its own layers (``MissingLayer`` stands in for the others, their
weights are never read) and caches KV for them alone. What runs where:

- stage 0: the embedding, its layers, and the LM head (and sampling, on rank 0);
- the middle stages: their layers;
- the last stage: its layers and the final norm.

A step: every rank receives the scheduled batch (the control plane of
``pagoda.engine.executor.tensor_parallel``); stage 0 embeds and runs its layers, then sends the hidden
states and the residual [tokens, hidden] to the same tensor-parallel slot of the next stage
(``torch.distributed`` send/recv: NCCL on CUDA, gloo on CPU), and so on; the last stage norms
and sends the final hidden states back to stage 0, whose LM head computes the logits that
rank 0 samples. The other stages return placeholder rows and compute no logits.

One step is in flight at a time (stages take turns); keeping several micro-batches in flight
is the next step (docs/distributed.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.errors import ConfigError


class MissingLayer(nn.Module):
    """A module another pipeline stage holds: no parameters, and calling it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer belongs to another pipeline stage")


def layer_ranges(num_layers: int, size: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """(start, end) of each stage's layers: ``partition`` (layers per stage) or an even split
    whose remainder goes to the last stages (stage 0 also embeds, computes logits and samples)."""
    if partition is not None:
        if len(partition) != size or sum(partition) != num_layers or min(partition) < 1:
            raise ConfigError(f"pp_layer_partition {partition} must give each of the pipeline_parallel_size={size} "
                              f"stages at least one layer and sum to the model's {num_layers} layers")
        counts = list(partition)
    else:
        if num_layers < size:
            raise ConfigError(f"pipeline_parallel_size={size} needs at least one layer per stage; the model has "
                              f"{num_layers}")
        base, extra = divmod(num_layers, size)
        counts = [base + (1 if s >= size - extra else 0) for s in range(size)]
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def is_pipelined() -> bool:
    return parallel_state.get_pipeline_stage()[1] > 1


def is_first_stage() -> bool:
    return parallel_state.get_pipeline_stage()[0] == 0


def is_last_stage() -> bool:
    stage, size, _, _ = parallel_state.get_pipeline_stage()
    return stage == size - 1


def stage_layers(num_layers: int) -> tuple[int, int]:
    """(start, end) of this rank's layers (all of them without pipeline parallelism)."""
    stage, size, _, ranges = parallel_state.get_pipeline_stage()
    if size == 1:
        return 0, num_layers
    if ranges[-1][1] != num_layers:
        raise ConfigError(f"the pipeline stages cover {ranges[-1][1]} layers but the model has {num_layers}")
    return ranges[stage]


def init_pipeline_groups(config, rank: int, world_size: int) -> None:
    """Create the tensor-parallel group of every stage (every rank takes part in creating
    each) and set this rank's stage. Needs ``num_hidden_layers`` only when the model is built."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    stage, tp_rank = divmod(rank, tp)
    group = None
    for s in range(pp):
        g = dist.new_group(ranks=list(range(s * tp, (s + 1) * tp)))
        if s == stage:
            group = g
    parallel_state.set_tp_group(group, tp_rank, tp)
    previous = rank - tp if stage > 0 else None
    following = rank + tp if stage < pp - 1 else None
    parallel_state.set_pipeline_stage(stage, pp, (previous, following, tp_rank), config.pp_layer_partition)


def resolve_ranges(num_layers: int) -> None:
    """Turn the configured partition (or None) into this run's layer ranges, once the model's
    layer count is known."""
    stage, size, peers, partition = parallel_state.get_pipeline_stage()
    if size == 1 or (partition and isinstance(partition[0], tuple)):
        return
    parallel_state.set_pipeline_stage(stage, size, peers, layer_ranges(num_layers, size, partition))


@dataclass(frozen=True)
class StageInfo:
    """What a model built on a pipeline stage remembers (the process may later build a
    one-device model next to it, which must not see the stage)."""

    stage: int
    size: int
    start: int  # this stage's layers: [start, end)
    end: int
    previous: int | None  # global rank to receive activations from (None: stage 0)
    following: int | None  # global rank to send them to (None: the last stage)
    first_peer: int  # global rank of this tensor-parallel slot on stage 0 (the LM head)
    last_peer: int  # global rank of this tensor-parallel slot on the last stage


def current_stage(num_layers: int) -> StageInfo | None:
    """This rank's stage (None without pipeline parallelism), read while a model is built."""
    stage, size, (previous, following, tp_rank), _ = parallel_state.get_pipeline_stage()
    if size == 1:
        return None
    start, end = stage_layers(num_layers)
    return StageInfo(stage, size, start, end, previous, following, tp_rank,
                     (size - 1) * parallel_state.get_tp_size() + tp_rank)


def stage_forward(model: nn.Module, info: StageInfo, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A Llama-shaped decoder's forward (``embed_tokens``, ``layers`` taking and returning
    (hidden, residual), ``norm``) on stage ``info``. Returns the final hidden states on stage 0
    and placeholder rows elsewhere."""
    num_tokens = input_ids.shape[0]
    if info.previous is None:
        hidden, residual = model.embed_tokens(input_ids), None
    else:
        hidden = _receive(num_tokens, model, info.previous)
        residual = _receive(num_tokens, model, info.previous)
    for layer in model.layers[info.start:info.end]:
        hidden, residual = layer(positions, hidden, residual)
    if info.following is not None:  # every stage holds >= 1 layer, so the residual is set
        dist.send(hidden.contiguous(), info.following)
        dist.send(residual.contiguous(), info.following)
    else:
        hidden, _ = model.norm(hidden, residual)
        dist.send(hidden.contiguous(), info.first_peer)  # back to the LM head on stage 0
    if info.previous is None:  # stage 0: the last stage's final hidden states
        return _receive(num_tokens, model, info.last_peer)
    return torch.zeros_like(hidden)


def _receive(num_tokens: int, model: nn.Module, src: int) -> torch.Tensor:
    width, dtype, device = model.pp_hidden_spec
    buf = torch.empty(num_tokens, width, dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf


def skip_other_stages(model: nn.Module, stream):
    """Leave the checkpoint tensors of the modules other stages hold unread (the safetensors
    reader is lazy: a skipped tensor's bytes are never read)."""
    prefixes = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, MissingLayer))
    if not prefixes:
        return stream
    make = stream._make
    stream._make = lambda sources: ((n, t) for n, t in make(sources) if not n.startswith(prefixes))
    return stream
