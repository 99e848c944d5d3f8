"""The CUDA memory budget at start-up: how many bytes the KV pool may take.

One profiling forward at the token budget (``max_num_batched_tokens``, one prefill: the
largest activation a step can have), then the LM head and a sampling pass over
``max_num_seqs`` rows, measures the activation peak with the caching allocator's own counter.
The KV pool gets what is left of ``gpu_memory_utilization`` of the device after the memory of
other processes, the weights, that peak, a reserve for the decode CUDA graphs and the
persistent step and sampling buffers (allocated after the pool, sized by the bounds)::

    kv_pool = total * utilization - used_by_others - weights - activation_peak - graph_reserve
              - buffers

``graph_reserve``: the graphs get a memory pool of their own (their activations cannot reuse
blocks of the eager pool), as large as the activations of the largest decode batch, which is
``max_num_seqs / num_tokens`` of the profiled peak, plus a fixed margin for the split-decode
partials and the allocator's rounding. After capture the runner knows the real figure
(``CudaDecodeGraphs.pool_bytes``) and the start-up log prints both.

The profiling forward writes its K/V into one scratch cache shared by every layer, sized for
its tokens, through a real block table, so a paged kernel reads only valid blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tailserve.model.attention import AttentionBackend, AttentionMetadata
from tailserve.model.llama import LlamaForCausalLM

GRAPH_RESERVE_MARGIN = 64 << 20


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling forward found (bytes) and what it left for the KV pool."""

    total_bytes: int
    utilization: float
    used_by_others_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    graph_reserve_bytes: int
    kv_cache_bytes: int
    buffers_bytes: int = 0  # the persistent step and sampling buffers

    def describe(self) -> str:
        gib = float(1 << 30)
        return (f"memory budget: {self.utilization:.0%} of {self.total_bytes / gib:.2f} GiB; "
                f"other processes {self.used_by_others_bytes / gib:.2f} GiB, weights "
                f"{self.weights_bytes / gib:.2f} GiB, activation peak "
                f"{self.activation_peak_bytes / gib:.2f} GiB, CUDA graph reserve "
                f"{self.graph_reserve_bytes / gib:.2f} GiB, step and sampling buffers "
                f"{self.buffers_bytes / gib:.3f} GiB, KV pool "
                f"{self.kv_cache_bytes / gib:.2f} GiB")


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tied tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def kv_budget(
    total: int, utilization: float, used_by_others: int, weights: int, activation_peak: int,
    graph_reserve: int, buffers: int = 0,
) -> int:
    """The KV pool's bytes (module docstring); never negative."""
    return max(int(total * utilization) - used_by_others - weights - activation_peak
               - graph_reserve - buffers, 0)


def graph_reserve_bytes(activation_peak: int, num_tokens: int, max_num_seqs: int) -> int:
    return activation_peak * min(max_num_seqs, num_tokens) // max(num_tokens, 1) + \
        GRAPH_RESERVE_MARGIN


@torch.inference_mode()
def profile_memory(
    model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
    dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_layers: int, num_tokens: int,
    max_num_seqs: int, block_size: int, scale: float, utilization: float, cuda_graphs: bool,
    buffers_bytes: int = 0,
) -> MemoryProfile:
    """Run the profiling forward on ``device`` (CUDA) and size the KV pool."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)  # the weights (and nothing else yet)
    n = num_tokens
    num_blocks = -(-n // block_size)
    scratch = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                          device=device)
    meta = AttentionMetadata(
        num_decodes=0, slot_mapping=torch.arange(n, device=device),
        query_start_loc=[0, n], query_lens=[n], seq_lens_list=[n],
        seq_lens=torch.tensor([n], device=device),
        block_tables=torch.arange(num_blocks, device=device)[None, :],
        block_size=block_size, scale=scale,
        query_start_loc_tensor=torch.tensor([0, n], device=device),
    )
    backend.begin_step(meta)
    ids = torch.zeros(n, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(n, device=device), [scratch] * num_layers, meta)
    rows = min(n, max_num_seqs)
    logits = model.compute_logits(hidden[-rows:])
    # The sampler's widest moment: probabilities and noise beside the logits.
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).uniform_()
    del probs, noise, logits, hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = max(total - free - torch.cuda.memory_reserved(device), 0)
    reserve = graph_reserve_bytes(peak, n, max_num_seqs) if cuda_graphs else 0
    kv = kv_budget(total, utilization, used_by_others, baseline, peak, reserve, buffers_bytes)
    return MemoryProfile(total, utilization, used_by_others, baseline, peak, reserve, kv,
                         buffers_bytes)
