"""What the GRPO loop needs from a rollout engine, whichever it is.

``megatron`` (rollout/megatron_backend.py): generation with the policy's own Megatron-Core weights, in
the trainer's processes; nothing to sync. ``vllm`` (rollout/vllm_backend.py): vLLM engines that
receive the policy's weights after every optimizer step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from oumi_megatron.rollout.sample import Sample
from oumi_megatron.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from oumi_megatron.engine.peft import AdapterWeights


@dataclass
class Rollout:
    """One generation of an engine: what a backend's ``generate`` returns per sample, and what the driver's episodes
    read as a turn (environments/episodes.py). The driver hands on ``Sample``s (rollout/sample.py), not these."""

    prompt_ids: list[int]
    completion_ids: list[int]
    finished: bool
    """True if the completion ended with EOS (False: cut at max_new_tokens)."""
    logprobs: list[float] | None = None
    """The engine's log p(token) of each completion token under softmax(logits / T) (full vocabulary;
    before top-p), the quantity the trainer recomputes: their difference is the rollout/trainer mismatch."""
    version: int | None = None
    """The policy version of the weights that generated it, where the engine reports one per generation (an engine
    whose weight pushes land between an episode's turns); None: the version of the whole batch (the driver's)."""


@dataclass
class WeightSyncStats:
    """One weight update of the rollout engines."""

    method: str
    tensors: int
    bytes: int
    seconds: float
    export_seconds: float = 0.0
    """Of ``seconds``, the time spent producing the HF tensors (the exporter), where the sync measures it
    (colocated): the rest is the engine loading them."""
    senders: int = 1
    """How many training ranks sent (rollout/weight_sync/senders.py); ``bytes`` is their total."""
    sender_bytes: int = 0
    """The largest sender's bytes (0: not counted per sender)."""
    probe_max_diff: float | None = None
    """After the sync, the largest |engine - trainer| logprob over a fixed probe sequence (None: not probed): a sync
    that silently did nothing shows here."""

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class EngineSleep:
    """What handing a colocated engine's GPU memory to the trainer cost (``RolloutBackend.sleep``)."""

    seconds: float = 0.0
    weights_dropped: bool = False
    """The engine freed its weights instead of keeping a copy: it generates again only after the next weight sync."""


@dataclass
class DecodeProfile:
    """What an engine that decodes in the trainer's processes reports of its loops (the embedded decoder); empty for
    engines elsewhere (vLLM: its calls are the device's share)."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds since start, summed over every call, by phase: ``decode`` (the prefill and decode loops), and of them
    ``prefill`` and ``graph_capture`` (the step profile's ``time/<phase>_s``: the collector reads their growth)."""
    decode_ms_per_step: float | None = None
    """The last call's decode step time."""
    path: str | None = None
    """The last call's generation path (e.g. whether the decode step's CUDA graph was captured, and why not)."""


@dataclass
class TaggedRollouts:
    """A generation that ran while the trainer went on (asynchronous GRPO): its rollouts, the policy version of the
    weights that generated them, and the engine's seconds on it."""

    rollouts: list[list[Rollout]]
    """A single generation's, grouped per prompt (``[]`` for an episode job)."""
    version: int
    """For episodes, the oldest version among their turns' (a weight push can land between two turns)."""
    engine_seconds: float
    episodes: tuple[list[Sample], Any] | None = None
    """An episode job's result (``submit_episodes``): its samples and their ``EpisodeStats``; None for a single
    generation."""


class PolicyWeights(Protocol):
    """The trainer's weights under HF names (engine/state/hf_weights.py ``HFWeightExporter``). Both calls are collective
    over the training ranks: every rank calls them, and iterates to the end."""

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for the whole model, on every rank."""
        ...

    def stage_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` of this rank's pipeline stage, on each of the stage's ranks."""
        ...

    def tp_shards(self, vocab: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, this rank's TP shard)`` for the whole model, ``vocab``: the vocabulary rows its engine holds."""
        ...

    def tp_shards_unsupported(self) -> str | None:
        """Why ``tp_shards`` cannot serve this model (None: it can); collective."""
        ...

    def save(self, folder: str | Path) -> Path:
        """The weights as an HF folder, written atomically."""
        ...

    def adapters(self) -> AdapterWeights | None:
        """The LoRA adapter alone, whole, on every rank (None: the policy has none); collective."""
        ...


class Generates(Protocol):
    """What multi-turn episodes need of an engine (environments/episodes.py): ``RolloutBackend.generate``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]: ...


class RolloutBackend(Protocol):
    """Generates completions; ``sync_weights`` makes the next ``generate`` use the trainer's current weights. The trainer
    brackets each generation phase with ``wake`` and ``sleep``."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """``n`` completions of each of ``prompts`` (distinct prompts: a GRPO group is one prompt with
        n = ``num_generations``), grouped per prompt in the prompts' order, as vLLM's ``SamplingParams(n=...)``:
        an engine that samples n per prompt computes the prompt once. ``seed`` makes the draw reproducible
        where the backend honours it (the embedded one does; vLLM's engines are seeded once at start)."""
        ...

    def sync_weights(self, weights: PolicyWeights) -> WeightSyncStats | None:
        """Load ``weights`` (the policy's, after an update) into the engines: collective over the trainer's ranks;
        None: nothing to do. A backend streams ``weights()`` or has ``weights.save(folder)`` written; it never
        exports the model itself."""
        ...

    def wake(self) -> float:
        """Before a generation phase (weight sync, then generate calls): engines that share the trainer's GPUs take
        back their memory (weights, KV cache). Returns the seconds spent; 0 where nothing sleeps."""
        ...

    def sleep(self) -> EngineSleep:
        """After a generation phase, before training: engines that share the trainer's GPUs hand it their memory."""
        ...

    def engine_metrics(self) -> dict[str, float]:
        """What the engines report beside the step's rollouts, on rank 0 (``{}`` elsewhere): the raw bandwidth of the
        weight-sync link (``weight_sync/raw_gbps``), engine restarts (``rollout/engine_restarts``)."""
        ...

    def decode_profile(self) -> DecodeProfile:
        """The decode loops so far, for the step profile and the metrics (``DecodeProfile()`` where none run here)."""
        ...

    def close(self) -> None: ...


@dataclass
class TurnEnd:
    """One episode's turn, ended: the policy's sampled ids of the turn and their logprobs (``row``: the episode, prompt
    ``row // n``'s sample ``row % n``)."""

    row: int
    ids: list[int]
    logprobs: list[float] | None
    """None where the engine returned none."""
    ended: bool
    """Its last token ends a turn (EOS or a stop token); False: cut at the turn's room."""
    versions: list[int | None] | None = None
    """Per token of ``ids``, the policy version that generated it, where the engine reports one (``Rollout.version``;
    a turn generated in pieces under ``grpo.partial_rollouts`` may span two); None: not reported."""


@dataclass
class NextTurn:
    """An episode goes on: ``appended`` (the environment's observation) follows the turn as context, then the policy
    samples up to ``room`` tokens."""

    appended: list[int]
    room: int


class Answering(enum.Enum):
    """A turn the environment answers in the background (``grpo.environment_workers`` >= 1): its next turn, or the
    episode's end, comes from a later ``TurnHandler.answered``."""

    ANSWERING = "answering"


ANSWERING = Answering.ANSWERING


class TurnHandler(Protocol):
    """The episodes' side of a batch (environments/episodes.py ``Episodes``): a backend hands it the turns that ended and
    gets back, per turn, the next one, None (the episode is over) or ``ANSWERING`` (it comes later, from ``answered``).
    Collective over the model replica: every rank of a replica calls both with the same turns at the same point."""

    background: bool
    """The environment answers in the background (``ANSWERING``): the embedded decoder keeps slots for rows to wait."""

    def turns_ended(self, ends: list[TurnEnd]) -> list[NextTurn | None | Answering]: ...

    def answered(self, wait: bool) -> list[tuple[int, NextTurn | None]]:
        """(row, its next turn or None) of the turns answered in the background since the last call; with ``wait``, at
        least one while any is being answered (the backend has nothing else to do). ``[]`` where none are."""
        ...


@dataclass
class EpisodeRun:
    """What a batch of episodes cost the engine (this rank's view)."""

    decode_steps: int = 0
    """Decode steps the batch took, every turn's (the static-cache decoder); 0 where the engine does not count them."""
    append_forwards: int = 0
    """Forwards that wrote observations into the cache, a group of rows' each (the static-cache decoder: at most one per
    look of its host); 0 where the engine does not run them."""
    continued_ttft_s: list[float] = field(default_factory=list)
    """Each continued turn's time from its observation being ready to its first token."""
    concurrency: float = 0.0
    """Episodes in flight (decoding or answered, not over), averaged over the decode steps."""
    answer_s: float = 0.0
    """Of the batch's time, the host's in ``TurnHandler.turns_ended`` (the environment's answers)."""


@runtime_checkable
class RunsEpisodes(Protocol):
    """A backend that runs multi-turn episodes itself, each at its own pace: a row whose turn ends is answered and takes
    its next turn while the others still decode theirs (the embedded static-cache decoder). Any other backend runs
    them turn by turn (rollout/turns.py ``turn_by_turn``: each turn a ``generate`` of the whole histories)."""

    def run_episodes(self, prompts: list[list[int]], params: SamplingParams, n: int, turns: TurnHandler, budget: int,
                     max_turns: int, seed: int | None = None) -> EpisodeRun:
        """``n`` episodes of each prompt (row ``i * n + j``: prompt i's sample j); each first turn samples up to
        ``params.max_new_tokens``; ``budget``: the most tokens of an episode's whole completion (turns and observations),
        ``max_turns`` its turns. Returns when every episode is over."""
        ...


@runtime_checkable
class AsyncRolloutBackend(RolloutBackend, Protocol):
    """A backend whose engines generate while the trainer trains (asynchronous GRPO, ``grpo.max_staleness`` > 0):
    generations are queued and collected in order, new weights are queued behind the generations in flight."""

    def submit(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """Queue ``n`` completions of each of ``prompts``; returns at once."""
        ...

    def collect(self) -> Any:
        """The oldest submitted generation (waits for it): ``.rollouts`` grouped per prompt, ``.version`` (the policy
        version that generated them) and ``.engine_seconds``."""
        ...

    def push_weights(self, weights: PolicyWeights, version: int) -> WeightSyncStats:
        """Collective over the training ranks: export the policy (version ``version``) now and queue it for the
        engines behind their generations in flight, without waiting for them."""
        ...

    def wait_pushed(self) -> float | None:
        """Wait for the weight push in flight; the seconds its transfer took (None: none was in flight)."""
        ...


@dataclass(frozen=True)
class EpisodeJob:
    """A batch of multi-turn episodes to run with an engine: ``batch``, what the episodes are (plain data: a fleet's
    rank 0 runs every replica's batch, rollout/ray_fleet.py), and ``run``, how this process runs a batch
    (environments/driver.py, with the episode thread's own tokenizer and environment). ``job(engine)`` is
    ``(samples, EpisodeStats)``."""

    batch: Any
    run: Callable[[Any, Generates], tuple[list[Sample], Any]]

    def __call__(self, engine: Generates) -> tuple[list[Sample], Any]:
        return self.run(self.batch, engine)


@runtime_checkable
class AsyncEpisodeBackend(AsyncRolloutBackend, Protocol):
    """An asynchronous backend that runs whole multi-turn episodes as its unit (``grpo.environment`` with
    ``max_staleness`` > 0): the episodes' turns are generated while the trainer trains, and the result is collected
    in order with the single generations (``collect(...).episodes``: the job's ``EpisodeStats``)."""

    def submit_episodes(self, prompts: list[list[int]], job: EpisodeJob) -> None:
        """Queue ``job`` (episodes of ``prompts``); returns at once. Every rank of a replica calls it."""
        ...


class VersionedCalls:
    """What an episode job's engine keeps of its calls (each generation tagged with the policy version that made it, a
    weight push landing between two): the oldest version, and the engine's seconds. ``run`` is the job's result as the
    backends hand it back: ``(oldest version, seconds, (samples, EpisodeStats))``."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.seconds = 0.0

    def tally(self, version: int, seconds: float) -> None:
        self.version = version if self.version is None else min(self.version, version)
        self.seconds += seconds

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[Rollout]]:
        """Each backend's own: its call, then ``tally`` of the version and seconds the engine reported."""
        raise NotImplementedError

    def run(self, job: EpisodeJob) -> tuple[int, float, tuple[list[Sample], Any]]:
        episodes = job(self)
        assert self.version is not None, "an episode job generates its first turn"
        return self.version, self.seconds, episodes


@runtime_checkable
class RunsEpisodeJobs(Protocol):
    """A backend whose engines one rank drives for every replica (the Ray fleet: rank 0): a replica cannot call them
    turn by turn on its own pace, so its synchronous episodes run as a job there too."""

    def run_episode_job(self, prompts: list[list[int]], job: EpisodeJob) -> TaggedRollouts:
        """Every replica's ``job`` (``.episodes``: this replica's samples and stats), waited for. Collective over the
        training ranks."""
        ...


StreamJob = Callable[[Generates], None]
"""The owner's stream of episodes (``grpo.streaming_groups``, environments/driver.py): runs until the run closes it,
generating with the engine it is given."""


@runtime_checkable
class StreamingEpisodeBackend(AsyncEpisodeBackend, Protocol):
    """An asynchronous backend whose owner runs one stream of episodes that groups join and leave at any time
    (``grpo.streaming_groups``): the driver feeds it and reads the groups it finishes, in the order they finish."""

    def start_stream(self, job: StreamJob) -> None:
        """Start ``job`` on the replica's owner (a thread of its own; the other ranks start nothing). Every rank of a
        replica calls it, once."""
        ...

    def from_owner(self, produce: Callable[[], Any]) -> Any:
        """``produce()``, called on the replica's owner, on every rank of the replica (collective over the replica)."""
        ...
