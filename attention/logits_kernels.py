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
def _best(score, cols, best, best_at):
    """A lane's running maximum and where it is."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_at)


@triton.jit
def _store_best(Best, BestAt, at, best, best_at, vocab_size):
    """A program's maximum over its lanes and the lowest position holding it."""
    top = tl.max(best, axis=0)
    tl.store(Best + at, top)
    tl.store(BestAt + at, tl.min(tl.where(best == top, best_at, vocab_size), axis=0))


@triton.jit
def _warped_sample_kernel(
    Logits,
    Rows,
    Temperature,
    Cutoff,
    Seed,
    Lse,
    Minus,
    MinusRows,
    Best,
    BestAt,
    Mass,
    stride_row,
    stride_minus,
    stride_best,
    vocab_size,
    num_chunks,
    HAS_MINUS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One chunk of draw ``i``'s entries: the largest ``scaled + Gumbel noise`` among the entries distribution
    ``Rows[i]`` keeps (``scaled >= cutoff``, divided as ``_warped_lse_kernel`` divides), and where it is; with
    ``HAS_MINUS``, the same for ``log(max(p - q, 0))`` (p the kept entries' ``exp(scaled - lse)``, q row
    ``MinusRows[i]`` of ``Minus``, none where it is -1) under the same noise, and the chunk's mass of
    ``max(p - q, 0)``. The noise of entry ``v`` of draw ``i`` is Philox's uniform number ``i * vocab_size + v``
    under the seed."""
    draw = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(Rows + draw)
    temperature = tl.load(Temperature + row)
    cutoff = tl.load(Cutoff + row)
    seed = tl.load(Seed)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    left = tl.full([BLOCK], float("-inf"), tl.float32)  # the residual's draw
    left_at = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    if HAS_MINUS:
        lse = tl.load(Lse + row)
        minus_row = tl.load(MinusRows + draw)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + offs
        inside = cols < vocab_size
        x = tl.load(Logits + row * stride_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        scaled = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * temperature)
        kept = inside & (scaled >= cutoff)
        noise = -tl.log(-tl.log(tl.rand(seed, draw * vocab_size + cols)))  # uniform 0: -inf, never drawn
        best, best_at = _best(tl.where(kept, scaled + noise, float("-inf")), cols, best, best_at)
        if HAS_MINUS:
            reads = inside & (minus_row + 0 * cols >= 0)  # a block mask (a scalar one fails the interpreter)
            q = tl.load(Minus + minus_row * stride_minus + cols, mask=reads, other=0.0)
            residual = tl.maximum(tl.where(kept, tl.exp(scaled - lse), 0.0) - q, 0.0)
            left, left_at = _best(tl.where(residual > 0, tl.log(residual) + noise, float("-inf")), cols, left, left_at)
            mass += residual
    at = draw * stride_best + chunk  # p's draw, then the residual's one chunk row further
    _store_best(Best, BestAt, at, best, best_at, vocab_size)
    if HAS_MINUS:
        _store_best(Best, BestAt, at + num_chunks, left, left_at, vocab_size)
        tl.store(Mass + draw * num_chunks + chunk, tl.sum(mass, axis=0))


def warped_sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    cutoff: torch.Tensor,
    seed: torch.Tensor,
    lse: torch.Tensor | None = None,
    minus: torch.Tensor | None = None,
    minus_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`attention.reference.warped_sample`; ``logits`` and ``minus`` are ``[R, V]`` with unit stride in
    ``V``. Each draw's chunks are searched by their own programs (W1's 256 rows alone would leave most of the GPU
    idle), then the best of them taken."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    has_minus = minus is not None
    if has_minus and minus.stride(-1) != 1:
        minus = minus.contiguous()
    draws, vocab_size = rows.shape[0], logits.shape[-1]
    if draws == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    chunk = min(SAMPLE_CHUNK, triton.next_power_of_2(vocab_size))
    block = min(SAMPLE_BLOCK, chunk)
    num_chunks = triton.cdiv(vocab_size, chunk)
    # Per draw and chunk: the draw from p, then (with ``minus``) the residual's draw, and the residual's mass.
    best = torch.empty(draws, 1 + has_minus, num_chunks, dtype=torch.float32, device=logits.device)
    best_at = torch.empty(draws, 1 + has_minus, num_chunks, dtype=torch.int32, device=logits.device)
    mass = torch.empty(draws, num_chunks if has_minus else 0, dtype=torch.float32, device=logits.device)
    _warped_sample_kernel[(draws, num_chunks)](
        logits,
        rows,
        temperature.float().contiguous(),
        cutoff.float().contiguous(),
        seed,
        lse if has_minus else cutoff,  # without HAS_MINUS: placeholders the kernel never reads
        minus if has_minus else logits,
        minus_rows if has_minus else rows,
        best,
        best_at,
        mass,
        logits.stride(0),
        minus.stride(0) if has_minus else 0,
        best.stride(0),
        vocab_size,
        num_chunks,
        HAS_MINUS=has_minus,
        BLOCK=block,
        CHUNK=chunk,
        num_warps=max(1, min(4, block // 256)),
    )
    tokens = best_at.gather(2, best.argmax(dim=2, keepdim=True))[..., 0].long()  # [draws, 1 + has_minus]
    if not has_minus:
        return tokens[:, 0]
    # The residual's draw where it has mass; p's where p and q agree up to rounding (any sample from p is exact).
    return torch.where(mass.sum(dim=1) > 0, tokens[:, 1], tokens[:, 0])
