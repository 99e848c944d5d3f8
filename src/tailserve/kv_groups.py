"""KV cache groups: how the layers of a sliding-window model share the block pool.

A sliding-window layer reads only the last ``sliding_window`` positions, so the blocks wholly
before the window of a sequence's next token are of no use to it any more; a global layer
reads every block. The layers are therefore split into *groups* of one kind each, every group
with its own block table per request (vLLM's hybrid allocator): a global group's table grows
with the sequence, a local group's releases its blocks as the window passes them (their table
slots then point at the null block, id 0, which the window masks never read).

One block id is one page of ``layers_per_block`` layers' K/V: every group has that many layer
slots, and slot ``j`` of every group lives in the same KV tensor, so a block id costs the same
memory whichever group holds it and one pool serves them all. With ``g`` global and ``l`` local
layers, ``layers_per_block = min(g, l)``; a kind whose count is not a multiple of it pads its
last group (those slots are memory no layer uses)::

    Gemma 3 270M (18 layers, 3 global):  groups [global x3] [local x3] x 5, pages of 3 layers
    Mistral (every layer slides):         one group [local x32], pages of 32 layers
    Llama (no window):                    one group [global x16], pages of 16 layers (as before)

Plain data, torch-free: the block manager (``kv/manager.py``) counts and releases with it, the
runner lays the pool out with it, ``tailserve plan`` sizes with it, the request checks count
with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroupLayout:
    """``group_windows[g]``: group g's window (None: global). ``layer_group[i]`` and
    ``layer_slot[i]``: where layer i's K/V live (its group's table, slot ``layer_slot[i]``
    of every block)."""

    group_windows: tuple[int | None, ...]
    layers_per_block: int
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def releases(self) -> bool:
        """Whether some group releases blocks (then block 0 is the pool's null block)."""
        return any(w is not None for w in self.group_windows)


def single_group(num_layers: int) -> KVGroupLayout:
    """Every layer in one global group: a block holds every layer (no release)."""
    return KVGroupLayout((None,), num_layers, (0,) * num_layers, tuple(range(num_layers)))


def kv_group_layout(layer_windows: Sequence[int | None], max_model_len: int,
                    release: bool = True) -> KVGroupLayout:
    """The groups for layers with these windows (None: global). One global group where
    ``release`` is off or no window is shorter than ``max_model_len`` (it would never bind)."""
    n = len(layer_windows)
    windows = {w for w in layer_windows if w is not None and w < max_model_len}
    if not release or not windows or n == 0:
        return single_group(n)
    if len(windows) > 1:
        raise ValueError(f"one sliding window per model is served, not {sorted(windows)}")
    window = windows.pop()
    kinds: list[tuple[int | None, list[int]]] = [
        (None, [i for i, w in enumerate(layer_windows) if w is None or w >= max_model_len]),
        (window, [i for i, w in enumerate(layer_windows) if w is not None and w < max_model_len]),
    ]
    kinds = [(w, layers) for w, layers in kinds if layers]
    per_block = min(len(layers) for _, layers in kinds)
    group_windows: list[int | None] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for w, layers in kinds:
        for start in range(0, len(layers), per_block):
            for slot, layer in enumerate(layers[start : start + per_block]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(w)
    return KVGroupLayout(tuple(group_windows), per_block, tuple(layer_group), tuple(layer_slot))


def first_needed_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a token at position ``num_computed_tokens`` (or later) still reads
    through a window of ``window`` positions: it sees ``p - window + 1 .. p``."""
    return max(0, (num_computed_tokens - window + 1) // block_size)


def max_blocks_per_seq(group_windows: Sequence[int | None], num_tokens: int, block_size: int,
                       max_chunk_tokens: int) -> int:
    """The most blocks, over all groups, one sequence of ``num_tokens`` tokens holds at once
    when scheduled in chunks of at most ``max_chunk_tokens``: a global group every block, a
    local group the blocks from the window of a chunk's first token to its last
    (at most ``cdiv(window - 1 + chunk, block_size) + 1``)."""
    full = cdiv(num_tokens, block_size)
    total = 0
    for w in group_windows:
        if w is None:
            total += full
        else:
            total += min(full, cdiv(w - 1 + max_chunk_tokens, block_size) + 1)
    return total


def blocks_per_seq(group_windows: Sequence[int | None], num_tokens: int, block_size: int) -> int:
    """Blocks one sequence of ``num_tokens`` tokens holds between steps (a decode's chunk
    of one token: what a finished prefill keeps), over all groups."""
    return max_blocks_per_seq(group_windows, num_tokens, block_size, 1)
