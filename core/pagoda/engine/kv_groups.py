"""KV cache groups: how a model that mixes sliding-window and global attention layers keeps
only the window's blocks for its window layers. No torch.

Layers are grouped by their window (``None``: global). Every group has its own block table
per sequence, drawn from one shared pool of block ids (``BlockManager``): a global group keeps
every block of a sequence, a window group gives back the blocks that left its window (their
table entries become ``NULL_BLOCK``). One block id must therefore be cheap for every group:
the layers are split into groups of the same size ``S`` (the smallest per-window layer count;
the last group of a window may be shorter), and the cache holds ``S`` tensors ("slots") of
``num_blocks`` pages each; the ``j``-th layer of every group reads and writes slot ``j``. A
block id then costs ``S`` layers' pages whichever group holds it (vLLM's hybrid KV cache layout).

Gemma 3 1B (22 window layers, 4 global, window 512): S = 4, one global group and six window
groups; a sequence of 4096 tokens holds 256 blocks in the global group and at most about 33 in
each window group (16-token blocks), 454 blocks of 4 layers instead of 256 blocks of 26.

A model whose layers share one window (all global, or Mistral's one window everywhere) keeps
one group and one tensor per layer, as before. Layers whose cache pages differ in shape (or
kind) cannot share slots: such a model keeps one group, every block in every layer, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheLayout:
    """``windows[g]``: group g's window (None: global; global groups first). Per attention layer
    (in the runner's order): ``layer_group`` and ``layer_slot`` (the cache tensor it uses);
    ``num_slots`` tensors are allocated. ``note``: why windows are not freed, when they could be."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int
    note: str = ""

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def frees_windows(self) -> bool:
        return any(w is not None for w in self.windows)


def plan_kv_layout(windows: list[int | None], page_shapes: list[tuple]) -> KVCacheLayout:
    """The layout for attention layers with these windows and cache page shapes (the backend's
    shape for one block, with the attention kind; equal shapes can share a slot)."""
    n = len(windows)
    if n == 0 or len(set(windows)) == 1:
        return KVCacheLayout((windows[0] if n else None,), (0,) * n, tuple(range(n)), n)
    if len(set(page_shapes)) > 1:
        return KVCacheLayout((None,), (0,) * n, tuple(range(n)), n,
                             note="its layers' cache pages differ in shape, so window layers keep every block")
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    size = min(len(layers) for layers in by_window.values())
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))  # global first, then narrow windows
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for w in order:
        layers = by_window[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(w)
    return KVCacheLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def blocks_for_one_sequence(layout_windows: tuple[int | None, ...], length: int, block_size: int,
                            step_tokens: int) -> int:
    """Blocks (over all groups) one sequence of ``length`` tokens may hold at once: every block in
    a global group; in a window group the window before a chunk of up to ``step_tokens`` new
    tokens, plus the chunk."""
    full = -(-length // block_size)
    total = 0
    for w in layout_windows:
        total += full if w is None else min(full, -(-(w - 1 + step_tokens) // block_size) + 1)
    return total
