"""One token per row drawn from logits in two Triton kernels (the decode step's sampling on a GPU).

The torch path (rollout/sampling.py ``pick_tokens``) takes six passes over a [rows, vocab] fp32 tensor a step:
log_softmax, exp, an exponential draw, its clamp, the division, the argmax. At a 152k vocabulary and 128 rows that is
~0.4 ms of a 1.5B model's 3.5 ms decode step on an H100 (bench_rollout --profile), for a result of two numbers a row.
Here the logits are read once: each program of the first kernel takes one slice of one row's vocabulary and keeps, in
fp32 registers, the slice's max and sum of exp (for the log-sum-exp over the whole vocabulary) and its Gumbel-max
winner (the argmax of ``logits / T + G``, G = -log(-log U) a standard Gumbel draw, over the usable columns: a draw
from softmax(logits / T) over them, the distribution of the torch path's exponential race); the second kernel
combines a row's slices and reads the winner's logit back for its log-probability. Greedy takes the argmax of the
logits (first index on ties, as ``torch.argmax``).

The uniform draws come from Triton's Philox, keyed by two 31-bit seeds that ``torch.randint`` draws from the caller's
generator each call (greedy: none): the same generator seed draws the same tokens, on every rank, in eager steps and in a CUDA
graph's replays (torch advances a captured generator's offset at each replay). The numbers differ from the torch
path's (another random stream, the same distribution).
"""

from __future__ import annotations

import torch

from oumi_megatron.engine.kernels.rope import triton

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["vocab", "columns", "row_stride", "inv_temperature", "slices"])
    def _slice_kernel(logits_ptr, seed_ptr, max_ptr, sum_ptr, key_ptr, index_ptr, vocab, columns, row_stride,
                      inv_temperature, slices, SLICE: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        start = part * SLICE
        if not GREEDY:  # greedy reads no seed (the caller draws none)
            seed = tl.load(seed_ptr).to(tl.uint64) * 2147483648 + tl.load(seed_ptr + 1).to(tl.uint64)
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        best_key = tl.full((), float("-inf"), tl.float32)
        best_index = tl.zeros((), tl.int64) + start
        for offset in range(0, tl.minimum(SLICE, columns - start), BLOCK):  # the last slice: its columns only
            cols = start + offset + tl.arange(0, BLOCK)
            inside = cols < columns
            x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
            x = x * inv_temperature
            block_max = tl.max(x, axis=0)
            new_max = tl.maximum(run_max, block_max)
            # the whole block outside (all -inf): keep the sum as it is, no exp(-inf - -inf)
            if new_max > float("-inf"):
                run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
                run_max = new_max
            if GREEDY:
                key = x
            else:
                u = tl.rand(seed, (row * columns + cols).to(tl.uint32))
                key = x - tl.log(-tl.log(u))  # u = 0: -inf, never drawn
            key = tl.where(cols < vocab, key, float("-inf"))  # Megatron's vocab padding: in the sum, never drawn
            block_best = tl.max(key, axis=0)
            if block_best > best_key:  # strictly: the first block holding the max keeps it (torch.argmax's ties)
                best_key = block_best
                best_index = tl.min(tl.where(key == block_best, cols, columns), axis=0).to(tl.int64)
        out = row * slices + part
        tl.store(max_ptr + out, run_max)
        tl.store(sum_ptr + out, run_sum)
        tl.store(key_ptr + out, best_key)
        tl.store(index_ptr + out, best_index)

    @triton.jit(do_not_specialize=["row_stride", "inv_temperature", "slices"])
    def _combine_kernel(logits_ptr, max_ptr, sum_ptr, key_ptr, index_ptr, token_ptr, logprob_ptr, row_stride,
                        inv_temperature, slices, SLICES: tl.constexpr):
        row = tl.program_id(0)
        parts = tl.arange(0, SLICES)
        inside = parts < slices
        maxes = tl.load(max_ptr + row * slices + parts, mask=inside, other=float("-inf"))
        sums = tl.load(sum_ptr + row * slices + parts, mask=inside, other=0.0)
        keys = tl.load(key_ptr + row * slices + parts, mask=inside, other=float("-inf"))
        indices = tl.load(index_ptr + row * slices + parts, mask=inside, other=0)
        top = tl.max(maxes, axis=0)
        lse = top + tl.log(tl.sum(tl.where(inside, sums * tl.exp(maxes - top), 0.0), axis=0))
        best = tl.max(keys, axis=0)
        token = tl.min(tl.where(keys == best, indices, 2**62), axis=0)  # the first slice's winner on ties
        x = tl.load(logits_ptr + row * row_stride + token).to(tl.float32) * inv_temperature
        tl.store(token_ptr + row, token)
        tl.store(logprob_ptr + row, x - lse)


SLICE = 8192
"""Columns of one row a program of the first kernel takes (a 152k vocabulary: 19 programs a row)."""
BLOCK = 1024


def sample_tokens(logits: torch.Tensor, temperature: float, vocab_size: int, greedy: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens long [rows], log-probabilities fp32 [rows]) of ``logits`` [rows, columns >= vocab_size], a row's token drawn
    from softmax(logits / temperature) over its first ``vocab_size`` columns (greedy: their argmax) and its
    log-probability under softmax(logits / temperature) over every column, as rollout/sampling.py's ``pick_tokens``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, columns = logits.shape
    slices = triton.cdiv(columns, SLICE)
    device = logits.device
    partial = torch.empty(3, rows, slices, dtype=torch.float32, device=device)
    index = torch.empty(rows, slices, dtype=torch.int64, device=device)
    # two 31-bit halves of Philox's 62-bit key, drawn on the device (a captured graph draws afresh at each replay);
    # greedy draws none, as the torch path (the generator's stream is where it was)
    seed = index if greedy else torch.randint(0, 2**31 - 1, (2,), device=device, generator=generator, dtype=torch.int64)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    inv_temperature = 1.0 / temperature
    _slice_kernel[(rows, slices)](logits, seed, partial[0], partial[1], partial[2], index, vocab_size, columns,
                                  logits.stride(0), inv_temperature, slices, SLICE=SLICE, BLOCK=BLOCK, GREEDY=greedy)
    _combine_kernel[(rows,)](logits, partial[0], partial[1], partial[2], index, tokens, logprobs, logits.stride(0),
                             inv_temperature, slices, SLICES=max(triton.next_power_of_2(slices), 2))
    return tokens, logprobs
