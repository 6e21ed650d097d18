"""The ``grpo:`` section of a MEGATRON_GRPO config.

Shared concepts use Oumi's ``GrpoParams`` field names (``num_generations``, ``temperature``,
``epsilon``, ``max_prompt_length``, ``max_completion_length``, ``log_completions``); the rest is what
current GRPO practice (DAPO, Dr. GRPO, NeMo-RL, verl, TRL) needs. Reward functions live here because
Oumi rejects ``training.reward_functions`` for trainer types other than TRL_GRPO / VERL_GRPO; they
resolve through Oumi's ``REWARD_FUNCTION`` registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oumi_megatron.config.base import BaseParams
from oumi_megatron.config.problems import choices

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig

ON_REWARD_ERROR = ("raise", "skip")
OFF_POLICY_CORRECTIONS = ("none", "tis", "seq_mask_tis", "icepop")
# IcePop's band of kept token ratios p_proximal / p_behaviour (Ling team, "Every Step Evolves", 2025: alpha 0.5, beta 5)
ICEPOP_BAND = (0.5, 5.0)
MAX_STALENESS = 4


@dataclass
class RewardFunctionParams(BaseParams):
    """One reward function from Oumi's REWARD_FUNCTION registry, weighted."""

    name: str = ""
    """Registered name (e.g. ``gsm8k``, ``countdown``, or your own ``@register(..., REWARD_FUNCTION)``)."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the function on every call."""


@dataclass
class SandboxParams(BaseParams):
    """Where code the model wrote runs (utils/sandbox.py): the ``python`` / ``python_tests`` environments and the
    ``code_tests`` reward. Each program gets these limits, a fresh working folder and no network; every process it
    leaves is killed. Started only when the config uses one of them; the log says which isolation is in force."""

    isolation: str = "auto"
    """``auto``: Linux namespaces (mount, network, PID, IPC, UTS; a read-only root; programs as a uid of their own)
    when the process is root, else bubblewrap where it is installed; neither: the run stops with the fixes.
    ``namespaces`` or ``bwrap``: that one or stop. ``limits_unsafe``: resource limits only: the model's code can read
    this machine's files and reach the network (the opt-out, by name)."""

    workers: int | None = None
    """Programs at once (a pre-started interpreter each). None: max(grpo.environment_workers, min(4, CPUs))."""

    timeout_s: float = 10.0
    """Wall-clock seconds per program; it and every process it started are killed then."""

    cpu_s: float | None = None
    """CPU seconds per process (RLIMIT_CPU). None: timeout_s."""

    memory_mb: int = 1024
    """Address space per process, MiB (RLIMIT_AS)."""

    max_processes: int = 32
    """Processes and threads of one program at once."""

    max_output_bytes: int = 65536
    """Each of stdout and stderr (and any file the program writes) is cut at this many bytes."""

    work_mb: int = 64
    """Size of the tmpfs that holds the working folder, MiB."""

    def settings(self, environment_workers: int = 0) -> Any:
        """As utils/sandbox.py takes them (``SandboxSettings``)."""
        import os

        from oumi_megatron.utils.sandbox import Limits, SandboxSettings

        workers = self.workers if self.workers is not None else max(environment_workers, min(4, os.cpu_count() or 1))
        limits = Limits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                        max_processes=self.max_processes, max_output_bytes=self.max_output_bytes)
        return SandboxSettings(self.isolation, workers, limits, self.work_mb)


@dataclass
class MegatronGrpoParams(BaseParams):
    """GRPO algorithm settings (rollouts, advantages, loss)."""

    # Rollouts. Names shared with Oumi's GrpoParams.
    num_generations: int = 8
    """Completions sampled per prompt (the group size); at least 2."""

    temperature: float = 0.9
    """Sampling temperature, in (0, 2]."""

    top_p: float = 1.0
    """Nucleus sampling probability mass, in (0, 1]."""

    max_prompt_length: int = 512
    """Prompts are left-truncated to this many tokens."""

    max_completion_length: int = 256
    """Most tokens generated per completion."""

    log_completions: bool = False
    """Log a few prompt/completion/reward samples every step."""

    rollout_dump_steps: int = 0
    """Every this many GRPO steps, write the step's samples of each data-parallel rank to
    ``output_dir/rollouts/step_XXXXXX_rank_XXXXX.jsonl`` (verl's ``rollout_data_dir``): one line per sample with its
    ``prompt_ids``, ``completion_ids``, ``loss_mask`` (null for single-turn), ``logprobs``, ``versions``, ``reward``
    and ``rewards``, ``turns``, ``status`` (finished, truncated or failed) and the decoded ``text``: what the policy and
    the environment said, token for token. 0: never."""

    eval_metric_prefixes: list[str] = field(default_factory=list)
    """One metric prefix per ``data.validation.datasets`` entry, in order: each prefix is its own eval set, e.g.
    ``[eval, eval_unseen]`` reports ``eval/accuracy`` and ``eval_unseen/accuracy`` (entries with the same prefix
    are pooled; TRL names a dict of eval datasets the same way, ``eval_<name>_...``). Empty: every validation
    dataset in one set, ``eval/``."""

    # Loss.
    epsilon: float = 0.2
    """Lower clip range of the importance ratio: ratio >= 1 - epsilon."""

    epsilon_high: float | None = None
    """Upper clip range (DAPO's clip-higher): ratio <= 1 + epsilon_high. Default: epsilon."""

    beta: float = 0.0
    """KL penalty coefficient to the reference (initial) policy; 0 disables the reference model."""

    kl_estimator: str = "k3"
    """KL estimator: ``k1`` (log ratio), ``k2`` (squared log ratio / 2) or ``k3`` (Schulman's)."""

    loss_aggregation: str = "token_mean"
    """``token_mean`` (DAPO), ``seq_mean`` (original GRPO) or ``seq_mean_token_sum_norm`` (Dr. GRPO)."""

    scale_rewards: bool | str = "group"
    """Divide the group-centred rewards by a std: ``group`` (each group's), ``batch`` (the whole batch's, TRL's
    name) or ``none`` (Dr. GRPO's mean-only advantages). true / false stay aliases of group / none."""

    policy_loss: str = "grpo"
    """Policy-gradient loss by registered name (grpo/registry.py): ``grpo`` (token-level clipped surrogate) or
    ``gspo`` (sequence-level importance ratio, Zheng et al. 2025), or your own from ``plugins``."""

    advantage_estimator: str = "grpo"
    """Advantages by registered name: ``grpo`` (group-relative, scaled per scale_rewards) or ``rloo``
    (leave-one-out baseline), or your own from ``plugins``."""

    clip_ratio_c: float | None = None
    """Dual clip (verl's clip_ratio_c, > 1, e.g. 3.0): where the advantage is negative the token's loss is at most
    -A x clip_ratio_c. None: off."""

    plugins: list[str] = field(default_factory=list)
    """Python modules imported before validation, data loading and training (oumi_megatron/plugins.py): they
    register policy losses / advantage estimators (``@register_policy_loss("name")``,
    ``@register_advantage_estimator("name")``, docs/grpo.md) and Oumi datasets / reward functions (Oumi's
    ``@register``; the CPU demo's task is ``oumi_megatron.examples.demo_task``)."""

    tis_cap: float | None = None
    """Truncated importance sampling: weight each token's policy-gradient term by
    min(p_trainer / p_rollout, tis_cap) to correct for rollout-engine vs trainer logprob drift
    (vLLM rollouts; e.g. 2.0). None: off, unless ``off_policy_correction`` asks for it (then 2.0)."""

    @property
    def off_policy_correction_choice(self) -> str:
        """``off_policy_correction`` resolved: unset is ``tis`` with ``tis_cap`` set, else ``none``."""
        if self.off_policy_correction is None:
            return "tis" if self.tis_cap is not None else "none"
        return self.off_policy_correction

    @property
    def importance_cap(self) -> float | None:
        """The cap of the truncated importance weights (``tis``, ``seq_mask_tis``), None under the others."""
        if self.off_policy_correction_choice not in ("tis", "seq_mask_tis"):
            return None
        return self.tis_cap if self.tis_cap is not None else 2.0

    @property
    def icepop_band(self) -> tuple[float, float]:
        """IcePop's [lower, upper] band of kept token ratios, the paper's where unset."""
        lower, upper = ICEPOP_BAND
        return (lower if self.icepop_lower is None else self.icepop_lower,
                upper if self.icepop_upper is None else self.icepop_upper)

    off_policy_correction: str | None = None
    """How the loss corrects for samples drawn by another policy than the one whose logprobs the trainer recomputes
    before the update (the proximal policy; verl's decoupled form): the rollout engine's (behaviour) logprobs of the
    sampled tokens, from vLLM, against the trainer's. ``tis``: each token's policy-gradient term weighted by
    min(p_proximal / p_behaviour, ``tis_cap``) (truncated importance sampling); ``seq_mask_tis``: the same, and a
    sequence whose geometric-mean ratio exp(mean log(p_proximal / p_behaviour)) is outside [1 / tis_cap, tis_cap]
    is left out of the loss (metric ``off_policy/masked_token_fraction``); ``icepop``: each token's term weighted by
    its ratio where the ratio lies inside [``icepop_lower``, ``icepop_upper``], and the token left out of the loss
    where it does not (IcePop's masked importance sampling; same metric); ``none``. Unset: ``tis`` when ``tis_cap``
    is set, else ``none``. ``tis`` and ``seq_mask_tis`` take ``tis_cap``, 2.0 when unset (verl's default
    threshold)."""

    icepop_lower: float | None = None
    """``off_policy_correction: icepop``: the smallest token ratio p_proximal / p_behaviour kept in the loss, in
    (0, 1). Unset: 0.5 (the IcePop paper's alpha)."""

    icepop_upper: float | None = None
    """``off_policy_correction: icepop``: the largest token ratio kept in the loss, > 1. Unset: 5.0 (the paper's
    beta)."""

    max_staleness: int = 0
    """Asynchronous GRPO (``megatron.rollout_placement: separate``): how many GRPO steps older than the trainer's
    policy the weights that generated a batch may be. 0: synchronous (each step generates with the weights it then
    trains). 1: one step off policy (verl's one-step off-policy, NeMo-RL's ``max_trajectory_age_steps: 1``): the
    engine generates the next batch while the trainer trains on this one, and the new weights are queued behind
    that generation, so the trainer does not wait for it. Up to 4 batches ahead. Metrics ``rollout/staleness_*``,
    ``async/*``."""

    partial_rollouts: bool = False
    """Asynchronous GRPO: a weight push does not wait for the episodes in flight. Each turn is generated in pieces of
    ``PARTIAL_ROLLOUT_CHUNK`` tokens (rollout/turns.py), each piece one request whose prompt is the episode's tokens so
    far (the engine's prefix cache serves them; nothing is sampled again or re-tokenized), so a push lands between two
    pieces and the episode goes on under the new weights; each token keeps the version that sampled it
    (``rollout/multi_version_fraction``). Needs ``max_staleness`` > 0 on a rollout mode that declares it (vLLM or
    SGLang separate, the vLLM Ray fleet)."""

    streaming_groups: bool = False
    """Asynchronous GRPO: the engine runs every episode group in flight side by side, each turn of each episode taken
    as soon as its observation is back, and a step trains on the first groups that complete (its share of
    ``prompts_per_rollout``), whichever step read them; groups still running carry over to the next step. A group
    whose oldest token would be more than ``max_staleness`` versions old is generated again (counted in
    ``rollout/groups_regenerated``), never trained on. Needs ``max_staleness`` > 0 on a rollout mode that declares it
    (vLLM or SGLang separate); with ``partial_rollouts`` turns also go in pieces."""

    # Multi-turn, tool-using episodes (environments/; docs/grpo.md "Multi-turn episodes and environments").
    environment: str | None = None
    """A registered environment (environments/registry.py: the built-in ``calculator``, or your own from ``plugins``)
    that answers each assistant turn with an observation (e.g. a tool's result, appended as context the policy is not
    trained on) or ends the episode. None: one completion per sample, scored as it is."""

    max_turns: int = 4
    """With ``environment``: the most assistant turns per episode (verl's ``max_assistant_turns``); an episode whose
    last turn still called a tool ends unfinished. ``max_completion_length`` bounds all turns and observations
    together."""

    max_turn_tokens: int | None = None
    """With ``environment``: the most tokens of one assistant turn. A turn cut there is closed with the end-of-turn
    token (context, not trained on) and answered by the environment like one the model ended. None: a turn may use
    what is left of ``max_completion_length`` (a turn cut by that ends the episode, unfinished)."""

    max_observation_tokens: int = 256
    """With ``environment``: an observation's text is cut to this many tokens (``env/observations_truncated``)."""

    environment_workers: int = 0
    """With ``environment``: how the environment answers the turns. 0: in line, while the decoder waits (the episodes a
    seed draws do not depend on how long the environment takes). N >= 1: on up to N threads in the background, so a
    slow tool (a sandbox, a judge, a remote call) delays only its own episode while the other rows decode; an ``async
    def step`` is awaited on one event loop. Then which decode step an answer meets depends on the environment's time,
    so sampled episodes may differ between runs (greedy ones do not), as in verl's AgentLoop. The environment's state
    shared across episodes (if any) must be thread-safe."""

    environment_timeout_s: float = 60.0
    """With ``environment``: the most seconds one environment call (``start`` or ``step``) may take; an episode whose
    call takes longer is stopped there and marked invalid (out of the loss and the group statistics, named in the log),
    and the run goes on."""

    sandbox: SandboxParams = field(default_factory=SandboxParams)
    """Where code the model wrote runs, with which limits (``SandboxParams``)."""

    # DAPO (Yu et al. 2025): dynamic sampling, overlong shaping and filtering.
    dynamic_sampling: bool = False
    """Drop prompt groups whose rewards are all equal (they have no advantage, so no policy gradient) and refill
    the batch with further prompts: up to ``dynamic_sampling_max_rounds`` rounds of generation per step, each of
    the step's number of prompts (verl's filter_groups, NeMo-RL's use_dynamic_sampling). Metrics
    ``dynamic_sampling/*`` count rounds, dropped and filled groups."""

    dynamic_sampling_max_rounds: int = 10
    """Most generation rounds per step under ``dynamic_sampling``. When they run out before the batch is full,
    the rest of the batch is dropped groups that are not trained on (a warning and ``dynamic_sampling/filled_groups``;
    verl and NeMo-RL stop the run instead); a step with no informative group skips its update."""

    overlong_buffer_length: int | None = None
    """DAPO's soft overlong punishment (verl's overlong_buffer.len): completions longer than
    max_completion_length - overlong_buffer_length tokens lose reward linearly, up to ``overlong_penalty_factor``
    at max_completion_length. None: off."""

    overlong_penalty_factor: float = 1.0
    """The most reward the overlong punishment takes (at max_completion_length)."""

    mask_truncated_completions: bool = False
    """DAPO's overlong filtering (TRL's name): completions cut at max_completion_length are not trained on
    (they still count in their group's reward statistics, as in TRL)."""

    # Updates per rollout batch.
    ppo_epochs: int = 1
    """Passes over each rollout batch (old logprobs are taken before the first)."""

    num_mini_batches: int = 1
    """Optimizer steps per pass; each uses megatron.global_batch_size sequences.

    Completions per GRPO step = megatron.global_batch_size x num_mini_batches.
    """

    # Rewards.
    reward_functions: list[RewardFunctionParams] = field(default_factory=list)
    """Weighted reward functions; the reward of a completion is their weighted sum."""

    on_reward_error: str = "raise"
    """A reward function that raises or returns NaN: ``raise`` stops the step, ``skip`` drops and counts the sample."""

    @property

    def max_sequence_length(self) -> int:
        """Longest sequence the trainer sees: prompt plus completion."""
        return self.max_prompt_length + self.max_completion_length


def check_rollout_dump_steps(config: MegatronTrainingConfig, found: Findings) -> None:
    """``grpo.rollout_dump_steps`` (trainer/rollout_dump.py writes the dumps)."""
    dump = config.grpo.rollout_dump_steps
    if not isinstance(dump, int) or isinstance(dump, bool) or dump < 0:
        found.add("grpo.rollout_dump_steps", f"must be an integer >= 0 (0: no dumps; N: every N-th step's samples to "
                                             f"output_dir/rollouts/), got {dump!r}.")


def check_sandbox(config: MegatronTrainingConfig, found: Findings) -> None:
    """``grpo.sandbox``: where model-written code runs, with which limits (``SandboxParams.settings`` hands them to
    utils/sandbox.py, whose choices these are)."""
    from oumi_megatron.utils.sandbox import ISOLATIONS, MAX_WORKERS

    s = config.grpo.sandbox
    if s.isolation not in ISOLATIONS:
        found.add("grpo.sandbox.isolation", f"unknown value {s.isolation!r}. Use one of {choices(ISOLATIONS)} "
                                            "(limits_unsafe: resource limits only, the model's code can read this machine's "
                                            "files and reach the network).")
    if s.workers is not None and (not isinstance(s.workers, int) or isinstance(s.workers, bool)
                                  or not 1 <= s.workers <= MAX_WORKERS):
        found.add("grpo.sandbox.workers", f"must be an integer in [1, {MAX_WORKERS}] or null (max(environment_workers, "
                                          f"min(4, CPUs))), got {s.workers!r}.")
    for name in ("timeout_s", "cpu_s"):
        value = getattr(s, name)
        if (value is not None or name == "timeout_s") and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                                           or not value > 0):
            found.add(f"grpo.sandbox.{name}", f"must be > 0 seconds{' or null (= timeout_s)' if name == 'cpu_s' else ''}, "
                                              f"got {value!r}. Typical: 10.")
    for name in ("memory_mb", "max_processes", "max_output_bytes", "work_mb"):
        found.positive(f"grpo.sandbox.{name}", getattr(s, name))
