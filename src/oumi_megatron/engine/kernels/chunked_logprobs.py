"""Token logprobs and entropy from the last hidden states, without the [tokens x vocab] fp32 logits.

GRPO needs, per token, log softmax(logits / T) at the sampled token (and, for metrics, the entropy). The
plain path materializes the logits ([b, s, V] bf16, a transposed copy, an fp32 copy, and Megatron's
cross-entropy buffers): for a 152k vocabulary and 16k tokens per microbatch that is ~10 GB on the last
pipeline stage. Here the output layer runs on ``chunk_tokens`` tokens at a time: each chunk's logits
live only while its max, log-sum-exp, target logit and entropy are taken (reduced over the TP group
when the vocabulary is split), and backward recomputes them chunk by chunk (one more output-layer GEMM,
~2% of a step's FLOPs) to form ``d logprob / d logits = onehot(target) - softmax``. The weight
gradient goes straight into the fp32 ``main_grad`` when ``gradient_accumulation_fusion`` is on, as
Megatron-Core's linear layers do.

It runs through Megatron-Core's ``GPTModel.forward(output_processor=...)`` hook on the last stage:
:func:`logprob_output_processor` replaces the output layer + logits there.

**Fused statistics** (``megatron.logprob_fusion``, on with CUDA): the eager path walks each chunk's logits in fp32
about ten times (the fp32 copy, max, subtract, exp, sums, entropy; the backward's softmax gradient likewise); at a
152k vocabulary that memory traffic, not the GEMMs, is most of the output layer's time. Fused, the same expressions
are compiled (torch.compile) into one kernel per reduction that reads the GEMM's model-dtype output once: the max,
then the sums given the (TP-reduced) max, and in the backward one kernel that writes the logits' gradient in the
model dtype. Same math and the same TP reductions; the sums' order differs, so results agree to fp32 rounding
(tests/test_gpu.py compares them with the eager path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig

AUTO_CHUNK_LOGITS = 1 << 27  # fp32 logits per auto-sized chunk: 512 MiB (4096 tokens at a 32k vocabulary)


def auto_chunk_tokens(vocab_shard: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take ~512 MiB."""
    return max(256, AUTO_CHUNK_LOGITS // max(1, vocab_shard))


def worth_chunking(tokens: int, vocab_shard: int) -> bool:
    """Auto mode chunks only a microbatch whose fp32 logits would pass one chunk: below that the chunked
    path saves little memory and costs its backward recompute (measured on an H200 at 4096 tokens x 32k:
    full logits 84.1k tokens/s, chunked 82.8k, same peak memory)."""
    return tokens * vocab_shard > AUTO_CHUNK_LOGITS


def check_logprob_chunks(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.logprob_chunk_tokens``: null (auto, the rule above), 0 (full logits) or tokens per chunk."""
    chunk = config.megatron.logprob_chunk_tokens
    if chunk is not None and chunk < 0:
        found.add("megatron.logprob_chunk_tokens",
                  f"must be null (auto), 0 (off: full logits) or a positive token count, got {chunk}.")


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T of one chunk (the GEMM's output is in the model dtype, as on the full-logits path)."""
    z = (h @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_max(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each row's max of the fp32 logits / T (one chunk's GEMM output ``z``)."""
    return _scaled(z, temperature).amax(dim=-1)


def _chunk_sums(z: torch.Tensor, temperature: float, m: torch.Tensor, index: torch.Tensor, mine: torch.Tensor,
                with_entropy: bool) -> torch.Tensor:
    """[2 or 3, rows]: sum exp(z' - m), the target's z' (0 where this shard lacks it) and, ``with_entropy``,
    sum exp(z' - m) (z' - m), where z' = fp32 logits / T."""
    zs = _scaled(z, temperature)
    target = torch.where(mine, zs.gather(1, index[:, None])[:, 0], 0.0)
    shifted = zs - m[:, None]
    e = shifted.exp()
    parts = [e.sum(dim=-1), target]
    if with_entropy:
        parts.append((e * shifted).sum(dim=-1))
    return torch.stack(parts)


def _chunk_logit_grad(z: torch.Tensor, temperature: float, lse: torch.Tensor, g: torch.Tensor, index: torch.Tensor,
                      mine: torch.Tensor) -> torch.Tensor:
    """d logprob / d logits of one chunk times the incoming gradient ``g``, in ``z``'s dtype:
    (onehot(target) - softmax(z')) g / T."""
    p = (_scaled(z, temperature) - lse[:, None]).exp()
    columns = torch.arange(z.shape[1], device=z.device)
    onehot = (columns[None, :] == index[:, None]) & mine[:, None]
    dz = p * -g[:, None] + torch.where(onehot, g[:, None], 0.0)
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(z.dtype)


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    z = z.float()
    return z / temperature if temperature != 1.0 else z


FUSED_STATISTICS: dict[str, Callable[..., torch.Tensor]] = {"max": _chunk_max, "sums": _chunk_sums,
                                                            "grad": _chunk_logit_grad}
"""What the fused path compiles, by name (tests run them uncompiled against the eager path)."""


@functools.cache
def _fused(name: str) -> Callable[..., torch.Tensor]:
    """The compiled form of ``FUSED_STATISTICS[name]``, built on first use (each reads a chunk's logits once)."""
    return torch.compile(FUSED_STATISTICS[name])


def _local_targets(targets: torch.Tensor, start: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's vocabulary shard, clamped; whether the shard holds the target)."""
    local = targets - start
    return local.clamp(0, vocab - 1), (local >= 0) & (local < vocab)


def _tp() -> tuple[Any, int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _all_reduce(t: torch.Tensor, op: Any, group: Any, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool, fuse_wgrad: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden [N, h] (model dtype), weight [V/tp, h] (this rank's vocabulary shard), targets [N] global ids
        group, world, rank = _tp()
        vocab = weight.shape[0]
        start = rank * vocab
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for i in range(0, n, chunk):
            index, mine = _local_targets(targets[i : i + chunk], start, vocab)
            if fused:  # the GEMM's model-dtype output, read once per kernel
                raw = hidden[i : i + chunk] @ weight.t()
                m = _all_reduce(_fused("max")(raw, temperature), dist.ReduceOp.MAX, group, world)
                sums = _all_reduce(_fused("sums")(raw, temperature, m, index, mine, with_entropy), dist.ReduceOp.SUM,
                                   group, world)
            else:
                z = _scaled_logits(hidden[i : i + chunk], weight, temperature)
                target = torch.where(mine, z.gather(1, index[:, None])[:, 0], 0.0)
                m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group, world)
                z.sub_(m[:, None])
                e = z.exp()
                parts = [e.sum(dim=-1), target]
                if with_entropy:
                    parts.append((e * z).sum(dim=-1))
                sums = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group, world)
            log_s = sums[0].log()
            lse[i : i + chunk] = m + log_s
            logprobs[i : i + chunk] = sums[1] - m - log_s
            if with_entropy:  # H = log sum exp(z') - E_p[z'] with z' = z - m
                entropy[i : i + chunk] = log_s - sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.fuse_wgrad, ctx.start, ctx.fused = temperature, chunk, fuse_wgrad, start, fused
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_entropy: Any) -> tuple:
        from oumi_megatron.engine.kernels.fusions import accumulate_wgrad

        hidden, weight, targets, lse = ctx.saved_tensors
        group, world, _ = _tp()
        vocab, start, t = weight.shape[0], ctx.start, ctx.temperature
        # A frozen output layer (LoRA's: the base's tied embedding) takes no weight gradient: skipping it saves a
        # [V/tp, h] fp32 buffer and, per chunk, a GEMM as large as the logits' and a read-write of that buffer
        need_wgrad = ctx.needs_input_grad[1]
        fused = need_wgrad and ctx.fuse_wgrad and hasattr(weight, "main_grad")
        # the fp32 weight gradient the chunks add to: Megatron-Core's main_grad when fused, else our own
        wgrad = None if not need_wgrad else weight.main_grad if fused else torch.zeros(
            weight.shape, dtype=torch.float32, device=weight.device)
        grad_hidden = torch.empty_like(hidden)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[i : i + ctx.chunk]
            g = grad[i : i + ctx.chunk].float()
            index, mine = _local_targets(targets[i : i + ctx.chunk], start, vocab)
            if ctx.fused:
                dz = _fused("grad")(h @ weight.t(), t, lse[i : i + ctx.chunk], g, index, mine)
            else:
                z = _scaled_logits(h, weight, t)
                # d logprob / d z = onehot(target) - softmax(z); times the incoming gradient, / T for the scaling
                p = z.sub_(lse[i : i + ctx.chunk, None]).exp_()
                dz = p.mul_(-g[:, None])
                dz.scatter_add_(1, index[:, None], torch.where(mine, g, 0.0)[:, None])  # no host sync
                if t != 1.0:
                    dz.div_(t)
                dz = dz.to(hidden.dtype)
            grad_hidden[i : i + ctx.chunk] = dz @ weight
            if wgrad is not None:
                accumulate_wgrad(h, dz, wgrad)
        _all_reduce(grad_hidden, dist.ReduceOp.SUM, group, world)  # each rank holds a vocabulary shard's part
        grad_w: torch.Tensor | None
        if wgrad is None:
            grad_w = None
        elif fused:  # Megatron-Core's convention (tensor_parallel/layers.py) for a wgrad already in main_grad
            if getattr(weight, "zero_out_wgrad", False):  # tied embedding: the embedding's own grad still flows
                grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
            else:
                grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
        else:
            grad_w = wgrad.to(weight.dtype)
        return grad_hidden, grad_w, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,  # [s, b, h]
    weight: torch.Tensor,  # [V/tp, h]
    targets: torch.Tensor,  # [b, s]
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: bool = False,
    fuse_wgrad: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [b, s] fp32, entropy [b, s] fp32 or None) of softmax(hidden @ weight^T / T); ``fused``: the
    statistics in compiled kernels (module docstring)."""
    s, b, h = hidden.shape
    flat = hidden.transpose(0, 1).reshape(b * s, h)
    logprobs, entropy = _ChunkedLogprobs.apply(flat, weight, targets.reshape(-1), float(temperature),
                                               int(chunk_tokens), with_entropy, fuse_wgrad, fused)
    return logprobs.view(b, s), (entropy.view(b, s) if with_entropy else None)


def logprob_output_processor(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: torch.Tensor | None,
                             context: dict[str, Any], config: Any, **_: Any) -> torch.Tensor:
    """``GPTModel.forward(output_processor=...)``: the last stage returns token logprobs [b, s] instead of
    logits; the entropy (no gradient) goes to ``context['entropy']``."""
    if getattr(output_layer, "bias", None) is not None or getattr(config, "use_mup", False):
        raise ValueError("chunked logprobs cover an unbiased, unscaled output layer; set megatron.logprob_chunk_tokens: 0")
    if getattr(output_layer, "sequence_parallel", False):
        # this rank holds a slice of the sequence: gather it; the backward's input gradient is already summed
        # over TP (_ChunkedLogprobs), so the gather's backward only keeps this rank's slice
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
    weight = output_layer.weight if output_weight is None else output_weight
    chunk = context["chunk_tokens"] or auto_chunk_tokens(weight.shape[0])
    logprobs, entropy = chunked_token_logprobs(
        hidden_states, weight, context["targets"], context["temperature"], chunk,
        context["with_entropy"], fuse_wgrad=bool(getattr(config, "gradient_accumulation_fusion", False)),
        fused=bool(context.get("fused", False)),
    )
    context["entropy"] = entropy
    return logprobs
