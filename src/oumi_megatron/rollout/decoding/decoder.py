"""Generation on the policy's own weights without a host round trip per token.

One call (``StaticCacheDecoder.generate``):
1. **Prefill once per prompt.** The distinct prompts, left-padded to one width, run once; each layer copies a
   prompt's keys/values into the cache rows of its ``n`` completions (static_cache.py).
2. **Decode steps with fixed shapes.** Every step feeds each row's newest token at one cache slot (a device
   tensor), attends under a [rows, slots] validity mask kept on the device, picks the next tokens on the device
   (rollout/sampling.py ``pick_tokens``) and writes them, their log-probabilities and the finished flags into
   preallocated buffers. The host only counts steps; it reads "has every row finished?" every
   ``check_every`` steps, and the tokens once at the end.
3. **CUDA graphs** (``megatron.rollout_cuda_graphs``): with one pipeline stage, dense layers and a CUDA device
   the whole decode step (embedding -> layers -> output layer -> sampling -> bookkeeping) is captured once
   per generation after one eager step and replayed; it reads the engine's parameters in place, so an
   optimizer step needs no re-capture. Pipeline stages (p2p per token) and MoE layers (token dispatch
   sizes go through the host) run the same step eagerly.
4. **Kept graphs** (``megatron.rollout_cuda_graphs_kept``): a generation's graph and device buffers (KV cache
   included) are kept for its shape, with the prompts' width rounded up to ``WIDTH_BUCKET``; a later call of the
   same shape refills the buffers in place and replays from its first step, with no eager step and no capture. Its
   prefill is captured too (the prompts' forward, launched eagerly from Python, costs tens of ms) and replayed on
   the refilled prompts.
   A kept graph is dropped when any parameter's storage moved since its capture (ModuleQueue re-attaches its
   weights to new storage; a graph reading the old addresses would read freed memory). A batch of multi-turn
   episodes (episodes.py) is one such generation: every turn of every row replays one decode-step graph, the
   observations' append forwards one graph per chunk bucket, and the next batch of the shape replays them again.

Positions: rotary angles are those of the cache slot (as Megatron-Core's static inference does), so a
left-padded row is shifted by a constant, which RoPE (relative) ignores; learned absolute position
embeddings get each row's own positions. Every rank of a model replica runs the same steps and draws from a
generator seeded the same, so all agree.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.config.megatron_params import ROLLOUT_CUDA_GRAPHS, ROLLOUT_DECODE_KERNELS
from oumi_megatron.engine.kernels.decode_attention import MAX_HEAD_DIM
from oumi_megatron.engine.kernels.rope import triton_runs_on_device
from oumi_megatron.rollout.decoding.generation_mode import forward_peers_done, generation_mode
from oumi_megatron.rollout.decoding.padding import left_pad, positions_and_mask
from oumi_megatron.rollout.decoding.policy_stages import DecodeKernels, PolicyStages
from oumi_megatron.rollout.decoding.static_cache import StaticKVCache
from oumi_megatron.rollout.sampling import SamplingParams, end_token_tensor, pick_tokens

if TYPE_CHECKING:
    from oumi_megatron.engine.engine import MegatronEngine

logger = logging.getLogger("oumi")

WIDTH_BUCKET = 64
"""Kept graphs: prompts are left-padded to a multiple of this many slots, so steps whose longest prompts differ
by a few tokens share a graph (RoPE is relative: the extra left padding changes no row's attention)."""


def bucketed_width(longest: int) -> int:
    """A kept generation's prompt width: the longest prompt's length rounded up to ``WIDTH_BUCKET``."""
    return -(-longest // WIDTH_BUCKET) * WIDTH_BUCKET

PREFILL_GRAPH_TOKENS = 4096
"""Kept generations capture their prefill where it feeds at most this many tokens (prompts x width): there the eager
prefill's Python launches, not its kernels, bound it, and the graph's memory (the prefill's activations, held while the
generation is kept) stays small; ``oumi-megatron plan`` counts it (plan.py ``kept_prefill_bytes``)."""


@dataclass
class GenerationStats:
    """One ``generate`` call of the embedded backend (this rank)."""

    path: str
    tokens: int
    """Generated tokens up to and including each row's EOS."""
    prefill_s: float
    decode_steps: int
    decode_s: float
    kv_cache_bytes: int = 0
    capture_s: float = 0.0
    """Of ``decode_s``: the CUDA graphs' captures, each with the eager run before it (the decode step's: once per call;
    multi-turn episodes: also each new append bucket's)."""
    steps_in_capture: int = 0
    """Of ``decode_steps``: those run eagerly before a capture (their time is in ``capture_s``)."""
    append_forwards: int = 0
    """Multi-turn episodes: the forwards that wrote observations into the cache (rollout/decoding/episodes.py)."""
    append_s: float = 0.0
    """Of ``decode_s``: those append forwards' time, but for the ones run before a capture (in ``capture_s``)."""
    append_tokens: tuple[int, int] = (0, 0)
    """The observations' tokens (their blocks') the appends fed, and the tokens their buckets computed (padding
    included)."""

    @property
    def decode_ms_per_step(self) -> float:
        """A decode step's time: with CUDA graphs a replay (captures and the eager runs before them excluded), append
        forwards excluded."""
        timed = self.decode_steps - self.steps_in_capture
        return 1e3 * (self.decode_s - self.capture_s - self.append_s) / max(timed, 1)


def resolve_cuda_graphs(requested: str, stages: PolicyStages) -> tuple[bool, str]:
    """(replay decode steps as a CUDA graph, why) for ``megatron.rollout_cuda_graphs``."""
    if requested not in ROLLOUT_CUDA_GRAPHS:
        raise ValueError(f"megatron.rollout_cuda_graphs must be one of {ROLLOUT_CUDA_GRAPHS}, got {requested!r}")
    if requested == "false":
        return False, "megatron.rollout_cuda_graphs: false"
    blocker = ("no CUDA device" if stages.device.type != "cuda" else
               "pipeline stages exchange activations every token (PP > 1)" if stages.pp > 1 else
               "MoE layers size their token dispatch on the host" if stages.is_moe else None)
    if blocker is None:
        return True, f"megatron.rollout_cuda_graphs: {requested}"
    if requested == "true":
        raise ValueError(f"megatron.rollout_cuda_graphs: true, but decode steps cannot be captured here: {blocker}. "
                         "Set megatron.rollout_cuda_graphs: auto (eager decode steps where graphs cannot run).")
    return False, f"auto: {blocker}"


def resolve_decode_kernels(requested: str, stages: PolicyStages) -> DecodeKernels:
    """Which of the decode step's Triton kernels run, for ``megatron.rollout_decode_kernels`` (decided once per decoder):
    ``auto`` the sampling kernel, the step's RoPE in the cache write and the residual adds in the norms, ``true`` the
    attention kernel as well."""
    if requested not in ROLLOUT_DECODE_KERNELS:
        raise ValueError(f"megatron.rollout_decode_kernels must be one of {ROLLOUT_DECODE_KERNELS}, got {requested!r}")
    if requested == "false":
        return DecodeKernels(False, False, "megatron.rollout_decode_kernels: false")
    unsupported = stages.unsupported_reason()
    blocker = ("no CUDA device for Triton" if not triton_runs_on_device(stages.device) else
               f"the static-cache decoder does not cover {unsupported}" if unsupported else None)
    if blocker is not None:
        if requested == "true":
            raise ValueError(f"megatron.rollout_decode_kernels: true, but the kernels cannot run here: {blocker}. Set "
                             "megatron.rollout_decode_kernels: auto (torch's sampling and SDPA where the kernels cannot run).")
        return DecodeKernels(False, False, f"auto: {blocker}")
    # RoPE inside the kernels only where it is the same arithmetic as the layers' own (else the layers rotate)
    rope_blocker = stages.rope_in_decode_kernels_reason()
    norms_blocker = stages.fused_residual_norms_reason()
    why = (f", RoPE in the layers ({rope_blocker})" if rope_blocker else "") + \
        (f", residual adds apart ({norms_blocker})" if norms_blocker else "")
    if requested == "auto":
        # cuDNN's SDPA over every cache slot beat the attention kernel over the slots in use at every shape measured
        # (scripts/bench_decode_attention.py, H100: 1.3-2x at 32-256 rows and 192-1024 slots); the sampling kernel and
        # the query's and key's RoPE in the cache write (four kernels a layer in one) won
        return DecodeKernels(True, False, "megatron.rollout_decode_kernels: auto; attention on SDPA, faster over every "
                             "slot than the attention kernel over the slots in use" + why, rope=rope_blocker is None,
                             residual_norms=norms_blocker is None)
    head_dim = max(a.hidden_size_per_attention_head for a in stages.attentions)
    blocker = ("layers not on attention_backend: sdpa" if not stages.takes_additive_masks else
               f"head dim {head_dim} > {MAX_HEAD_DIM}" if head_dim > MAX_HEAD_DIM else None)
    if blocker is not None:
        raise ValueError(f"megatron.rollout_decode_kernels: true, but the decode attention kernel cannot run: {blocker}. "
                         "Set megatron.rollout_decode_kernels: auto (attention on the layers' own kernel).")
    return DecodeKernels(True, True, "megatron.rollout_decode_kernels: true" + why, rope=rope_blocker is None,
                         residual_norms=norms_blocker is None)


class KeptGenerations:
    """Up to ``limit`` generations' device state (graph, buffers, KV cache) by shape, least recently used dropped first;
    an entry is valid only while the storage it was captured on (``fingerprint``) has not moved."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: OrderedDict[Hashable, tuple[tuple[int, ...], Any]] = OrderedDict()

    def take(self, key: Hashable, fingerprint: tuple[int, ...]) -> Any | None:
        """The generation kept for ``key`` (removed: ``keep`` puts it back), or None (none, or its storage moved)."""
        entry = self.entries.pop(key, None)
        return entry[1] if entry is not None and entry[0] == fingerprint else None

    def keep(self, key: Hashable, fingerprint: tuple[int, ...], run: Any) -> None:
        self.entries[key] = (fingerprint, run)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)


class StaticCacheDecoder:
    """Generation through ``PolicyStages`` and a static KV cache (the embedded backend's default path)."""

    def __init__(self, engine: MegatronEngine, vocab_size: int, cuda_graphs: str = "auto", check_every: int = 16,
                 graphs_kept: int = 1, decode_kernels: str = "auto") -> None:
        self.engine = engine
        self.stages = PolicyStages(engine)
        self.stages.kernels = resolve_decode_kernels(decode_kernels, self.stages)
        self.vocab_size = vocab_size
        self.peers_done: Callable[[bool], bool] = functools.partial(forward_peers_done, engine)
        """Whether every expert peer's loop is done too (rollout/decoding/generation_mode.py)."""
        self.graphs, why = resolve_cuda_graphs(cuda_graphs, self.stages)
        self.check_every = check_every
        if graphs_kept < 0:
            raise ValueError(f"megatron.rollout_cuda_graphs_kept must be >= 0, got {graphs_kept}")
        self.kept = KeptGenerations(graphs_kept if self.graphs else 0)
        self.path = ("static KV cache, " + ("CUDA-graph decode steps" if self.graphs else "eager decode steps")
                     + f" ({why}); {self.stages.kernels.describe()}")

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
        """``n`` completions of each prompt (rows ``i * n .. i * n + n - 1``): tokens [rows, T] (``pad_token_id`` after
        a row's EOS) and their log-probabilities, on the host, with the call's stats."""
        with generation_mode(self.engine):
            run, keep = self.prepare(prompts, n, params, generator)
            out = self.run(run, functools.partial(run.prefill, self.kept.limit > 0))
            keep()
        return out

    def prepare(self, prompts: list[list[int]], n: int, params: SamplingParams,
                generator: torch.Generator) -> tuple[_Generation, Callable[[], None]]:
        """The device state of a generation of ``prompts``: the one kept for this shape, refilled in place, or a new one;
        ``keep()`` after its first decode keeps it for the next call of the shape (once it holds a graph)."""
        return self.prepared(None, prompts, n, params, generator,
                             lambda width: _Generation.for_prompts(self.stages, prompts, n, params, self.vocab_size,
                                                                   generator, width))

    def prepared(self, kind: Hashable, prompts: list[list[int]], n: int, params: SamplingParams, generator: torch.Generator,
                 make: Callable[[int | None], _Generation]) -> tuple[Any, Callable[[], None]]:
        """``prepare`` for any kind of generation: ``make(width)`` builds a new one (``width``: the prompts' bucketed
        width when it is kept, else None); ``kind`` tells generations of different buffers apart (a batch of episodes,
        rollout/decoding/episodes.py)."""
        if not self.kept.limit:
            return make(None), lambda: None
        width = bucketed_width(max(len(p) for p in prompts))
        key, fingerprint = (len(prompts) * n, width, params, kind), self._storage_fingerprint()
        kept = self.kept.take(key, fingerprint)
        if kept is None or kept.generator is not generator:
            kept = make(width)
        else:
            kept.refill(prompts, n, params)

        def keep() -> None:
            if kept.graph is not None:
                self.kept.keep(key, fingerprint, kept)

        return kept, keep

    def _storage_fingerprint(self) -> tuple[int, ...]:
        """Where every parameter's data lives: a captured graph reads these addresses."""
        return tuple(p.data_ptr() for chunk in self.engine.model for p in chunk.parameters())

    def run(self, run: _Generation, prefill: Callable[[], None]) -> tuple[torch.Tensor, torch.Tensor, GenerationStats]:
        """``prefill`` (the prompts, or a continued turn's block), then the decode steps: tokens and logprobs on the
        host, with the stats (inside ``generation_mode``)."""
        params = run.params
        started = time.perf_counter()
        prefill()
        run.synchronize()
        prefill_s = time.perf_counter() - started
        steps = run.decode(self.graphs, self.check_every, self.peers_done)
        tokens, logprobs = run.tokens[:, :steps].cpu(), run.logprobs[:, :steps].cpu()
        decode_s = time.perf_counter() - started - prefill_s
        path = self.path.replace("CUDA-graph", "eager (capture failed)") if run.capture_failed else self.path
        stats = GenerationStats(path=path, tokens=generated_tokens(tokens, params), prefill_s=prefill_s,
                                decode_steps=steps - 1, decode_s=decode_s, kv_cache_bytes=run.cache.nbytes,
                                capture_s=run.capture_s, steps_in_capture=run.steps_in_capture)
        return tokens, logprobs, stats


def generated_tokens(tokens: torch.Tensor, params: SamplingParams) -> int:
    """Tokens of ``tokens`` [rows, T] a generation produced: each row's up to and including its first EOS (or stop
    token)."""
    ends = end_token_tensor(params)
    if ends is None:
        return tokens.numel()
    ended = torch.isin(tokens, ends).int()
    # a row counts its tokens up to its first EOS (inclusive); after it only padding
    after_eos = (ended.cumsum(1) - ended) > 0
    return int((~after_eos).sum())


class _Generation:
    """The device state of one ``generate`` call (episodes.py: of a batch of episodes)."""

    def __init__(self, stages: PolicyStages, params: SamplingParams, vocab_size: int, generator: torch.Generator,
                 n: int, rows: int, width: int, extra_slots: int = 0) -> None:
        """``width``: the slot of the first token decoded (the prompts' width; a continued turn's history and block).
        ``extra_slots``: cache slots beyond ``width + max_new_tokens`` (a batch of episodes' later turns)."""
        self.stages, self.n, self.params, self.vocab_size, self.generator = stages, n, params, vocab_size, generator
        self.ends = end_token_tensor(params, stages.device)
        """The tokens that end a row (EOS and the stop tokens), on the device; a captured step reads this tensor."""
        self.captured_params = params
        """The sampling the graph (once captured) replays; a continued turn may change only ``max_new_tokens``."""
        device = stages.device
        self.width = self.prompt_width = width
        new = max(params.max_new_tokens, 1)
        slots = self.width + new + extra_slots
        self.prompt_ids = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.prompt_real = torch.zeros(0, 0, dtype=torch.bool)
        """The left-padded prompts ``prefill`` runs (``load_prompts``), and where their real tokens are (on the host)."""
        self.prompt_positions = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.prompt_mask = torch.zeros(0, 1, 0, 0, dtype=torch.bool, device=device)
        """The prefill's position ids and mask (``positions_and_mask``), on the device: a captured prefill reads them."""
        self.prefill_graph: torch.cuda.CUDAGraph | None = None
        """The prefill's graph (kept generations: ``prefill``); a refill of the same prompt shape replays it."""
        self.tokens = torch.full((rows, new), params.pad_token_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, new, dtype=torch.float32, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.valid = torch.zeros(rows, slots, dtype=torch.bool, device=device)
        """Which cache slots each row attends to: its real prompt tokens and its tokens up to its EOS."""
        self.current = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.picked = torch.zeros(rows, dtype=torch.long, device=device)
        self.picked_logprob = torch.zeros(rows, dtype=torch.float32, device=device)
        self.cache = StaticKVCache(stages.attentions, rows, slots, stages.config.params_dtype, device)
        self.cursor = self.cache.cursor
        if stages.kernels.attention:  # decode steps attend through the kernel, which reads it in place (static_cache.py)
            self.cursor.valid = self.valid
        self.rotary = stages.rotary_table(slots)
        self.capture_failed = False
        self.capture_s = 0.0
        self.steps_in_capture = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        """The decode step's graph once captured; a kept generation replays it in later calls (``refill``)."""
        self.graph_pool: Any = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        """The memory pool this generation's graphs share: they never run at the same time, and what one hands to the
        next lives in buffers allocated before any capture."""
        dtype = stages.config.params_dtype
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device) if stages.takes_additive_masks else None

    def synchronize(self) -> None:
        if self.stages.device.type == "cuda":
            torch.cuda.synchronize(self.stages.device)

    @classmethod
    def for_prompts(cls, stages: PolicyStages, prompts: list[list[int]], n: int, params: SamplingParams,
                    vocab_size: int, generator: torch.Generator, width: int | None = None) -> _Generation:
        """``n`` completions of each of ``prompts``, left-padded to one width (the longest, or ``width``; ``prefill``
        runs them)."""
        ids, real = left_pad(prompts, params.pad_token_id, width)
        run = cls(stages, params, vocab_size, generator, n, len(prompts) * n, ids.shape[1])
        run.load_prompts(ids, real, n)
        run.valid[:, :run.width] = real.repeat_interleave(n, dim=0).to(stages.device)
        return run

    def load_prompts(self, ids: torch.Tensor, real: torch.Tensor, n: int) -> None:
        """The left-padded prompts (``left_pad``) the next ``prefill`` runs, ``n`` rows each: into the device buffers in
        place where their shape is the last call's (a captured prefill reads them), else new buffers (and the prefill's
        graph, captured on the old ones, dropped)."""
        positions, mask = positions_and_mask(real)
        device = self.stages.device
        if ids.shape == self.prompt_ids.shape and n == self.n:
            self.prompt_ids.copy_(ids)
            self.prompt_positions.copy_(positions)
            self.prompt_mask.copy_(mask)
        else:
            self.prompt_ids, self.prompt_positions, self.prompt_mask = ids.to(device), positions.to(device), mask.to(device)
            self.prefill_graph = None
        self.n, self.prompt_real = n, real

    def refill(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        """A kept generation's buffers, in place (the graph reads them), for ``prompts`` of its shape and ``params``
        (those it was made with): as ``for_prompts`` would set them. The cache keeps the last call's keys and values:
        a slot is read only once ``valid`` says so."""
        self.use(params, self.prompt_width)  # an episode's later turns changed them
        ids, real = left_pad(prompts, params.pad_token_id, self.width)
        self.load_prompts(ids, real, n)
        valid = torch.zeros_like(self.valid)
        valid[:, :self.width] = real.repeat_interleave(n, dim=0).to(self.stages.device)
        self.restart(valid)

    def use(self, params: SamplingParams, width: int) -> None:
        """The next call (or turn) decodes with ``params`` from slot ``width``. A captured graph that samples otherwise
        is dropped; ``max_new_tokens`` may differ (the host counts the steps)."""
        if replace(params, max_new_tokens=self.captured_params.max_new_tokens) != self.captured_params:
            self.graph = None  # ``_capture`` records the next graphs' sampling (the prefill's samples token 0)
            self.prefill_graph = None
        if params.end_ids != self.params.end_ids:  # a new tensor only then: a kept graph reads the one it was captured on
            self.ends = end_token_tensor(params, self.stages.device)
        self.params, self.width = params, width

    def restart(self, valid: torch.Tensor) -> None:
        """Every per-call buffer reset in place for a new decode (a refilled call, or an episode's next turn, whose
        realigned history ``valid`` marks)."""
        self.tokens.fill_(self.params.pad_token_id)
        self.logprobs.zero_()
        self.finished.zero_()
        self.valid.copy_(valid)
        self.current.zero_()
        self.step.zero_()
        self.capture_s = 0.0
        self.steps_in_capture = 0

    # -- the steps ---------------------------------------------------------------------------------------------------
    def prefill(self, graph: bool = False) -> None:
        """The prompts' forward and every row's token 0. ``graph`` (a generation kept for later calls of its shape) and
        at most ``PREFILL_GRAPH_TOKENS``: the first call runs it eagerly and captures it, later calls replay it (an eager
        prefill is ~30 launches a layer from Python: tens of ms where a replay takes its kernels' few)."""
        if self.prefill_graph is not None:
            self.prefill_graph.replay()
        elif graph and self.prompt_ids.numel() <= PREFILL_GRAPH_TOKENS and not self.capture_failed:
            decode_captures = self.capture_s
            self.prefill_graph = self._capture(self._prefill)
            self.capture_s = decode_captures  # the prefill's capture is prefill time (``prefill_s``), not decode time
        else:
            self._prefill()

    def _prefill(self) -> None:
        rotary = None if self.rotary is None else self.rotary[:self.width]
        self.cursor.prefill_repeat = self.n
        try:
            with self.stages.generating(self.cache):
                logits = self.stages.forward(self.prompt_ids, self.prompt_positions, self.prompt_mask, rotary)
        finally:
            self.cursor.prefill_repeat = 0
        self.cursor.slot.fill_(self.width)  # token 0 is fed at the first slot after the prompts
        self._record(None if logits is None else logits.repeat_interleave(self.n, dim=0))

    def decode_step(self, kv_len: int | None) -> None:
        """Feed the newest token of every row at ``cursor.slot``; pick and record the next one."""
        valid = self.valid if kv_len is None else self.valid[:, :kv_len]
        # each row's own position, for learned absolute embeddings only (RoPE uses the cache slot)
        positions = valid.sum(dim=-1, keepdim=True) - 1 if self.stages.learned_positions else None
        rotary = None if self.rotary is None else self.rotary.index_select(0, self.cursor.slot)
        self.cursor.kv_len = kv_len
        logits = self.stages.forward(self.current, positions, self._mask(valid), self._layer_rotary(rotary))
        self.cursor.slot += 1
        self._record(logits)

    def _layer_rotary(self, rotary: torch.Tensor | None) -> torch.Tensor | None:
        """A decode step's rotary angles for the layers; None where the decode kernels rotate (they read them from the
        cursor)."""
        if not self.stages.kernels.rope:
            return rotary
        self.cursor.rotary = rotary
        return None

    def _mask(self, valid: torch.Tensor) -> torch.Tensor | None:
        """[rows, 1, 1, slots]: boolean (True = may not attend), or for SDPA the additive bias, built once per step;
        None where the decode attention kernel takes the step (it reads ``valid`` itself)."""
        if self.stages.kernels.attention:
            return None
        if self.neg_inf is None:
            return ~valid[:, None, None, :]
        return torch.where(valid[:, None, None, :], self.zero, self.neg_inf)

    def _pick(self, logits: torch.Tensor | None, picked: torch.Tensor, picked_logprob: torch.Tensor) -> None:
        """Each row's sample and its logprob from the last stage's logits, written in place into ``picked`` and
        ``picked_logprob`` (buffers a captured graph reads) and shared with the other pipeline stages (``logits``: None
        on a stage before the last)."""
        if logits is not None:
            tokens, logprobs = pick_tokens(logits, self.params, self.vocab_size, self.generator,
                                           fused=self.stages.kernels.sampling)
            picked.copy_(tokens)
            picked_logprob.copy_(logprobs)
        self.stages.share_from_last_stage(picked, picked_logprob)

    def _record(self, logits: torch.Tensor | None) -> None:
        """The next token of every row (pad after its EOS), from the last stage's logits, into the buffers."""
        self._pick(logits, self.picked, self.picked_logprob)
        token = torch.where(self.finished, self.params.pad_token_id, self.picked)
        self.tokens.index_copy_(1, self.step, token[:, None])
        self.logprobs.index_copy_(1, self.step, self.picked_logprob[:, None])
        self.valid.index_copy_(1, self.cursor.slot, (~self.finished)[:, None])  # the slot ``token`` is fed at
        if self.ends is not None:
            self.finished |= (token[:, None] == self.ends[None, :]).any(dim=1)
        self.current.copy_(token[:, None])
        self.step += 1

    # -- the loop ------------------------------------------------------------------------------------------------------
    def decode(self, graphs: bool, check_every: int, peers_done: Callable[[bool], bool]) -> int:
        """Decode steps after the prefill's token until ``max_new_tokens`` or every row (and every expert peer,
        ``peers_done``) has finished; the number of tokens per row generated."""
        total = self.params.max_new_tokens
        step = 1
        with self.stages.generating(self.cache):
            while step < total:
                if self.graph is not None:  # captured in this call, or kept from an earlier one (``refill``)
                    self.graph.replay()
                elif graphs and not self.capture_failed:
                    self.graph = self._capture()  # runs this step eagerly, then captures one for the next ones
                    self.steps_in_capture += self.graph is not None
                else:
                    self.decode_step(self.width + step)
                step += 1
                if step % check_every == 0 and step < total and peers_done(bool(self.finished.all())):
                    break
        return step

    def _capture(self, step: Callable[[], None] | None = None) -> torch.cuda.CUDAGraph | None:
        """One eager run of ``step`` (default: the decode step over every slot; the prefill, an append) on a side stream
        (it warms up the kernels of these shapes), then the capture of one for replays. None if capture fails (logged;
        the run continues eagerly)."""
        run = step if step is not None else functools.partial(self.decode_step, None)
        started = time.perf_counter()
        stream = torch.cuda.Stream(device=self.stages.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.generator)
        self.captured_params = self.params
        try:
            with torch.cuda.graph(graph, pool=self.graph_pool):
                run()
        except RuntimeError as e:
            logger.warning("rollout: a CUDA graph of a decode step could not be captured (%s); running it eagerly", e)
            self.capture_failed = True
            return None
        torch.cuda.synchronize(self.stages.device)
        self.capture_s += time.perf_counter() - started
        return graph
