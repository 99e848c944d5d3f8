"""16-bit weights on a float32 CPU model: stored as bf16 / fp16, widened where they are read.

A decode step streams every weight once, so weights kept in 16 bits halve its bytes. The
model's activations stay float32 (``RunnerConfig.compute_dtype``); only the matmul weights
and the embedding table keep the checkpoint's 16-bit dtype (``RunnerConfig.dtype``):

=================  ==================  ==============================================
plain module       swapped for          computes
=================  ==================  ==============================================
``nn.Linear``      ``Linear16``         ``panel16_linear`` on 16-bit panels, any rows
``nn.Embedding``   ``WideEmbedding``    the looked-up rows, widened to float32
=================  ==================  ==============================================

``panel16_linear`` widens the weights in registers (AVX2 + F16C), or for bfloat16 on a CPU with
AVX512-BF16 uses its native dot product on activations rounded to bfloat16
(``TAILSERVE_CPU_BF16_DOT=0`` forces the widening). It serves prefill chunks too, without a
float32 copy of the weights: one thread, 256 x 576 x 1536 on a Zen 5 host, the native path
did 303 GFLOPS, oneDNN's float32 GEMM on a prepacked weight 228, the widening path (blocks of
8+ rows widen each panel once into a float32 tile) 119, as fast as the float32 panel kernel
(121); widening the whole weight per call and calling MKL was slower still (benchmarks/
benchmarks/notes/weights.md, "16-bit storage"; benchmarks/storage16_kernels.py).

A tied LM head is the embedding table: ``share_tied_table`` makes the embedding read its rows
from the head's panels, so the table is stored once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HALF_DTYPES = (torch.bfloat16, torch.float16)


def panel16_weight(w: torch.Tensor) -> torch.Tensor:
    """[out, in] in 16 bits -> the panels ``panel16_linear`` reads (out padded to 16s).

    bfloat16: [out/16, in_p/2, 32], each pair of k (in padded to even, in_p) for 16 columns
    side by side (vdpbf16ps's operand layout); float16: [out/16, in, 16], k by k.
    """
    out_f, in_f = w.shape
    n_pad = -out_f % 16
    if n_pad:
        w = torch.cat([w, w.new_zeros(n_pad, in_f)])
    n = w.shape[0]
    if w.dtype == torch.bfloat16:
        k_pad = in_f % 2
        if k_pad:
            w = torch.cat([w, w.new_zeros(n, 1)], dim=1)
        kp = w.shape[1]
        return w.view(n // 16, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous().view(
            n // 16, kp // 2, 32)
    if w.dtype == torch.float16:
        return w.view(n // 16, 16, in_f).transpose(1, 2).contiguous()
    raise ValueError(f"panel16_weight: want a bfloat16 or float16 weight, got {w.dtype}")


def panel16_rows(panel: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``rows`` of the [out, in] weight a panel holds, widened to float32: [len, in]."""
    if panel.dtype == torch.bfloat16:
        p = panel.view(panel.shape[0], panel.shape[1], 16, 2)
        picked = p[rows // 16, :, rows % 16, :]  # [len, in_p/2, 2]
        return picked.reshape(rows.shape[0], -1)[:, :in_features].float()
    return panel[rows // 16, :, rows % 16].float()  # [len, in]


class Linear16(nn.Module):
    """The ``nn.Linear`` it replaces, on a 16-bit panel copy of its weight, float32 in/out.

    It keeps the original ``weight`` only where another module shares it (a tied LM head is
    the embedding table, until ``share_tied_table`` lets it go), so memory stays at one
    16-bit copy of each weight.
    """

    weight: torch.Tensor | None  # the replaced linear's weight, where another module shares it
    bias: torch.Tensor | None  # float32

    def __init__(self, linear: nn.Linear, *, shared: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        if w.dtype not in HALF_DTYPES:
            raise ValueError(f"Linear16 needs a bfloat16 or float16 weight, got {w.dtype}")
        self.panel = panel16_weight(w)
        self.weight = linear.weight if shared else None
        self.bias = linear.bias
        self._weight_bytes = w.numel() * w.element_size()

    @property
    def bytes_added(self) -> int:
        """Memory beyond the weight it replaced: its panels, less the weight if it let it go."""
        return self.panel.numel() * self.panel.element_size() - (
            self._weight_bytes if self.weight is None else 0)

    @property
    def exact_panels(self) -> bool:
        """Whether the panels hold exactly ``out_features`` columns (no padding)."""
        return self.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.tailserve.panel16_linear(x, self.panel, self.bias)
        return y if self.exact_panels else y[:, : self.out_features].contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight_dtype={self.panel.dtype}")


class WideEmbedding(nn.Module):
    """``nn.Embedding`` over a 16-bit table; the looked-up rows come out float32.

    The rows come from ``weight`` [vocab, hidden], or from a tied LM head's panels
    (``share_tied_table``), so the table is not stored twice.
    """

    weight: torch.Tensor | None

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.weight = embedding.weight
        # A tied head's panels (share_tied_table): a plain attribute, not a submodule, so the
        # module tree stays the model's.
        self.head_panel: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden] float32
        if self.head_panel is not None:
            return panel16_rows(self.head_panel, input_ids, self.embedding_dim)
        assert self.weight is not None  # kept until a head takes the table over
        return F.embedding(input_ids, self.weight).float()


def share_tied_table(model: nn.Module) -> int:
    """Where a ``Linear16`` LM head and a ``WideEmbedding`` share one table, let the embedding
    read the head's panels and drop the table from both; returns the bytes freed."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not (type(embed) is WideEmbedding and type(head) is Linear16):
        return 0
    if embed.weight is None or head.weight is not embed.weight or not head.exact_panels:
        return 0
    freed = embed.weight.numel() * embed.weight.element_size()
    embed.head_panel = head.panel
    embed.weight = None
    head.weight = None
    return freed


def _storage_params(model: nn.Module) -> set[int]:
    """ids of the parameters kept in the weights' dtype: matmul weights and embedding tables."""
    keep: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            keep.add(id(module.weight))
    return keep


@torch.no_grad()
def cast_for_storage(model: nn.Module, weight_dtype: torch.dtype, compute_dtype: torch.dtype
                     ) -> None:
    """Matmul weights and embedding tables in ``weight_dtype``, every other parameter (norms,
    biases) in ``compute_dtype``, in place. Run before ``load_weights``: the checkpoint's
    tensors are then copied once into their final dtype, never through a float32 model."""
    keep = _storage_params(model)
    for param in model.parameters():
        want = weight_dtype if id(param) in keep else compute_dtype
        if param.dtype != want:
            param.data = param.data.to(want)


def computes_in_float32(model: nn.Module) -> bool:
    """Whether the model's activations are float32: its parameters other than matmul weights
    and embeddings are float32, and those are float32 or 16-bit."""
    keep = _storage_params(model)
    for param in model.parameters():
        ok = (torch.float32, *HALF_DTYPES) if id(param) in keep else (torch.float32,)
        if param.dtype not in ok:
            return False
    return True
