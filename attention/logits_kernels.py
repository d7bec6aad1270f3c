"""Triton kernels over a forward's logits rows: the normaliser of each row's warped distribution.

Rejection sampling needs the target's probability of a few tokens per row (the drafts) and a whole row only where
it draws a token (one per round). Materialising the warped fp32 probabilities of every verify row (W1: 2,304
rows x 49,152 tokens, 450 MB) took several full passes (divide, mask, softmax, gathers) of ~1 ms each on an
H200; one read of the model's logits gives each row's log-normaliser, and from it any probability on demand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # vocabulary entries per iteration of a row's loop


@triton.jit
def _warped_lse_kernel(Logits, Temperature, Cutoff, Lse, stride_row, vocab_size, BLOCK: tl.constexpr):
    """One row: ``logsumexp`` of ``logits / temperature`` over the entries at or above the row's cut-off (in
    scaled units; -inf keeps every entry), with an online max and sum per lane. The division rounds to nearest,
    as PyTorch's does, so an entry is kept exactly when the reference keeps it."""
    row = tl.program_id(0)
    temperature = tl.load(Temperature + row)
    cutoff = tl.load(Cutoff + row)
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + offs
        x = tl.load(Logits + row * stride_row + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        scaled = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * temperature)
        scaled = tl.where(scaled >= cutoff, scaled, float("-inf"))
        new_top = tl.maximum(top, scaled)
        anchor = tl.where(new_top == float("-inf"), 0.0, new_top)  # a lane that has kept nothing yet
        total = total * tl.exp(top - anchor) + tl.exp(scaled - anchor)
        top = new_top
    row_top = tl.max(top, axis=0)
    anchor = tl.where(row_top == float("-inf"), 0.0, row_top)
    tl.store(Lse + row, anchor + tl.log(tl.sum(total * tl.exp(top - anchor), axis=0)))


def warped_lse(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """See :func:`attention.reference.warped_lse`; ``logits`` is ``[R, V]`` with unit stride in ``V``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab_size = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return lse
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab_size))
    _warped_lse_kernel[(rows,)](
        logits,
        temperature.float().contiguous(),
        cutoff.float().contiguous(),
        lse,
        logits.stride(0),
        vocab_size,
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )
    return lse
