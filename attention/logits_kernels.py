"""Triton kernels over a forward's logits rows: the normaliser of each row's warped distribution, and a draw from it.

Rejection sampling needs the target's probability of a few tokens per row (the drafts) and a whole row only where
it draws a token (one per round). Materialising the warped fp32 probabilities of every verify row (W1: 2,304
rows x 49,152 tokens, 450 MB) took several full passes (divide, mask, softmax, gathers) of ~1 ms each on an
H200; one read of the model's logits gives each row's log-normaliser, and from it any probability on demand.
A plain decoding step only draws: materialising its rows' probabilities and handing them to ``torch.multinomial``
took ~12 passes over ``[256, 49K]`` fp32 (~0.45 ms of a 9 ms W1 step on the H200); a Gumbel-max draw reads the
logits once and needs no normaliser.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # vocabulary entries per iteration of a row's loop
SAMPLE_BLOCK = 1024  # vocabulary entries per iteration of a draw's loop
SAMPLE_CHUNK = 4096  # vocabulary entries one program of a draw reads: a row's chunks run in parallel


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


@triton.jit
def _warped_sample_kernel(
    Logits,
    Rows,
    Temperature,
    Cutoff,
    Seed,
    Best,
    BestAt,
    stride_row,
    vocab_size,
    num_chunks,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One chunk of distribution ``Rows[i]``'s entries: the largest ``scaled + Gumbel noise`` among those kept
    (``scaled >= cutoff``, divided as ``_warped_lse_kernel`` divides), and where it is. The noise of entry ``v`` of
    draw ``i`` is Philox's uniform number ``i * vocab_size + v`` under the step's seed."""
    draw = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(Rows + draw)
    temperature = tl.load(Temperature + row)
    cutoff = tl.load(Cutoff + row)
    seed = tl.load(Seed)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + offs
        inside = cols < vocab_size
        x = tl.load(Logits + row * stride_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        scaled = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * temperature)
        uniform = tl.rand(seed, draw * vocab_size + cols)  # in [0, 1): 0 gives -inf, never drawn
        score = tl.where(inside & (scaled >= cutoff), scaled - tl.log(-tl.log(uniform)), float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_at = tl.where(better, cols, best_at)
    top = tl.max(best, axis=0)
    tl.store(Best + draw * num_chunks + chunk, top)
    tl.store(BestAt + draw * num_chunks + chunk, tl.min(tl.where(best == top, best_at, vocab_size), axis=0))


def warped_sample(
    logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor, seed: torch.Tensor
) -> torch.Tensor:
    """See :func:`attention.reference.warped_sample`; ``logits`` is ``[R, V]`` with unit stride in ``V``. Each
    draw's chunks are searched by their own programs (W1's 256 rows alone would leave most of the GPU idle), then
    the best of them taken."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draws, vocab_size = rows.shape[0], logits.shape[-1]
    if draws == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    chunk = min(SAMPLE_CHUNK, triton.next_power_of_2(vocab_size))
    block = min(SAMPLE_BLOCK, chunk)
    num_chunks = triton.cdiv(vocab_size, chunk)
    best = torch.empty(draws, num_chunks, dtype=torch.float32, device=logits.device)
    best_at = torch.empty(draws, num_chunks, dtype=torch.int32, device=logits.device)
    _warped_sample_kernel[(draws, num_chunks)](
        logits,
        rows,
        temperature.float().contiguous(),
        cutoff.float().contiguous(),
        seed,
        best,
        best_at,
        logits.stride(0),
        vocab_size,
        num_chunks,
        BLOCK=block,
        CHUNK=chunk,
        num_warps=max(1, min(4, block // 256)),
    )
    return best_at.gather(1, best.argmax(dim=1, keepdim=True))[:, 0].long()
