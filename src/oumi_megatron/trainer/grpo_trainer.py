"""``OumiMegatronGrpoTrainer``: prompts -> rollouts -> rewards -> advantages -> Megatron-Core update.

One GRPO step:
1. take the next ``prompts_per_rollout`` prompts (a seeded permutation of the dataset; the position is
   checkpointed), render them with the tokenizer's chat template, left-truncate;
2. generate ``num_generations`` completions per prompt with the rollout backend (the embedded Megatron
   backend samples from the policy's own weights, so there is nothing to sync);
3. score them with the weighted reward functions; group-relative advantages;
4. old logprobs (and reference logprobs when beta > 0) without gradients, before any update;
5. ``ppo_epochs`` x ``num_mini_batches`` optimizer steps with the GRPO loss;
6. metrics to metrics.jsonl / TensorBoard; checkpoints every ``training.save_steps``; at the end the HF
   export to output_dir/hf_model and PNG plots.

Every rank runs the same loop (generation and updates are collective); each data-parallel rank
trains on its shard of the rollout batch.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.checkpointing import AsyncCheckpointWriter, latest_checkpoint, load_checkpoint, save_checkpoint
from oumi_megatron.engine.conversion import save_hf
from oumi_megatron.grpo.algorithm import group_advantages
from oumi_megatron.grpo.loss import make_grpo_loss_fn
from oumi_megatron.grpo.rewards import RewardComputer
from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend, Rollout
from oumi_megatron.rollout.sampling import SamplingParams
from oumi_megatron.trainer.metrics import MetricsLogger, plot_curves

try:  # Oumi's trainer interface (absent on engine-only machines)
    from oumi.core.trainers.base_trainer import BaseTrainer
except ImportError:  # pragma: no cover
    BaseTrainer = object  # type: ignore[misc,assignment]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ReferenceWeights:
    """The initial policy for the KL term, kept on the CPU (no second model on the GPU)."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.params = [p for c in chunks for p in c.parameters()]
        self.initial = [p.detach().to("cpu", copy=True) for p in self.params]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        current = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p, ref in zip(self.params, self.initial):
                p.copy_(ref)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(self.params, current):
                    p.copy_(cur)


class OumiMegatronGrpoTrainer(BaseTrainer):
    def __init__(self, config: Any, engine: Any, bridge: Any, checkpoint_dir: Path, layout: Any, tokenizer: Any, dataset: Any) -> None:
        self.config = config
        self.engine = engine
        self.bridge = bridge
        self.hf_artifacts = Path(checkpoint_dir) / "hf"
        self.layout = layout
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.grpo = config.grpo
        self.output_dir = Path(config.training.output_dir)
        self.rewards = RewardComputer(self.grpo.reward_functions, self.grpo.on_reward_error)
        self.backend = MegatronRolloutBackend(engine, vocab_size=len(tokenizer), seed=config.training.seed)
        self.sampling = SamplingParams(
            temperature=self.grpo.temperature,
            top_p=self.grpo.top_p,
            max_new_tokens=self.grpo.max_completion_length,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        self.reference = ReferenceWeights(engine.model) if self.grpo.beta > 0 else None
        self.loss_fn = make_grpo_loss_fn(self.grpo)
        self.step = 0
        self.data_position = 0
        self.order = list(range(len(dataset)))
        random.Random(config.training.seed).shuffle(self.order)
        self.last_metrics: dict[str, Any] = {}
        use_async = config.megatron.checkpoint_config.use_async_checkpoint
        self.async_writer = AsyncCheckpointWriter() if use_async else None

    # -- data ---------------------------------------------------------------------------------------
    def _next_rows(self, n: int) -> list[dict[str, Any]]:
        rows = []
        for _ in range(n):
            rows.append(self.dataset[self.order[self.data_position % len(self.order)]])
            self.data_position += 1
        return rows

    def _prompt_ids(self, row: dict[str, Any]) -> list[int]:
        prompt = row["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return ids[-self.grpo.max_prompt_length :]

    # -- batches ------------------------------------------------------------------------------------
    def _sequences(self, rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompt+completion ids and the completion mask at logprob positions."""
        pad = self.sampling.pad_token_id
        length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        ids = torch.full((len(rollouts), length), pad, dtype=torch.long)
        mask = torch.zeros((len(rollouts), length), dtype=torch.float32)
        for i, r in enumerate(rollouts):
            seq = r.prompt_ids + r.completion_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            # logprob position t scores token t + 1: completion tokens sit at len(prompt) .. len(seq)-1
            mask[i, len(r.prompt_ids) - 1 : len(seq) - 1] = 1.0
        return ids, mask

    def _microbatches(self, tensors: dict[str, torch.Tensor], rows: range | list[int]) -> list[dict[str, torch.Tensor]]:
        mbs = self.layout.micro_batch_size
        idx = list(rows)
        return [{k: v[idx[i : i + mbs]] for k, v in tensors.items()} for i in range(0, len(idx), mbs)]

    def _dp_rows(self, start: int, count: int) -> range:
        from megatron.core import parallel_state as ps

        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per = count // dp
        return range(start + rank * per, start + (rank + 1) * per)

    # -- one GRPO step ------------------------------------------------------------------------------
    def grpo_step(self) -> dict[str, Any]:
        g = self.grpo
        t0 = time.perf_counter()
        rows = self._next_rows(self.layout.prompts_per_rollout)
        prompt_ids = [self._prompt_ids(r) for r in rows]
        rollouts = self.backend.generate(prompt_ids, self.sampling, g.num_generations)
        t_rollout = time.perf_counter() - t0

        completions = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
        prompts = [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids for _ in range(g.num_generations)]
        group_rows = [row for row in rows for _ in range(g.num_generations)]
        rewards = self.rewards(prompts, completions, group_rows)
        advantages = group_advantages(rewards.total.float(), g.num_generations, g.scale_rewards)
        advantages = torch.where(rewards.valid, advantages, torch.zeros_like(advantages))

        ids, mask = self._sequences(rollouts)
        mask = mask * rewards.valid[:, None].float()  # samples dropped by on_reward_error: skip
        n, length = ids.shape
        per_mini = self.layout.global_batch_size
        # the rows this data-parallel rank trains on: its shard of every mini-batch
        shards = [self._dp_rows(m * per_mini, per_mini) for m in range(g.num_mini_batches)]
        mine = [i for shard in shards for i in shard]
        t1 = time.perf_counter()
        # old (and reference) logprobs: before any update of this step, no gradients
        mine_mbs = self._microbatches({"input_ids": ids}, mine)
        old = torch.zeros(n, length)
        old[mine] = torch.cat(self.engine.compute_logprobs(mine_mbs, g.temperature))[:, :length]
        batch = {"input_ids": ids, "completion_mask": mask, "advantages": advantages, "old_logprobs": old}
        if self.reference is not None:
            ref = torch.zeros(n, length)
            with self.reference.active():
                ref[mine] = torch.cat(self.engine.compute_logprobs(mine_mbs, g.temperature))[:, :length]
            batch["ref_logprobs"] = ref
        t_logprob = time.perf_counter() - t1

        t2 = time.perf_counter()
        results = []
        for _ in range(g.ppo_epochs):
            for shard in shards:
                results.append(self.engine.train_step(self._microbatches(batch, shard), self.loss_fn, g.temperature))
        t_train = time.perf_counter() - t2

        self.step += 1
        last = results[-1]
        tokens = max(last.metrics.get("completion_tokens", 0.0), 1.0)
        lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float32)
        metrics: dict[str, Any] = {
            "reward/mean": rewards.total.mean().item(),
            "reward/std": rewards.total.std().item() if n > 1 else 0.0,
            **{f"reward/{k}": v.mean().item() for k, v in rewards.per_function.items()},
            "reward/invalid_samples": int((~rewards.valid).sum()),
            "advantage/mean": advantages.mean().item(),
            "advantage/std": advantages.std().item() if n > 1 else 0.0,
            "loss": sum(r.loss for r in results) / len(results),
            "kl": last.metrics.get("kl_sum", 0.0) / tokens,
            "clip_fraction": last.metrics.get("clipped_tokens", 0.0) / tokens,
            "grad_norm": last.grad_norm,
            "lr": last.lr,
            "completion_length/mean": lengths.mean().item(),
            "completion_length/max": int(lengths.max()),
            "completion_length/truncated_fraction": sum(not r.finished for r in rollouts) / n,
            "time/rollout_s": t_rollout,
            "time/logprob_s": t_logprob,
            "time/train_s": t_train,
            "time/sync_s": 0.0,  # embedded backend: the rollout engine is the policy itself
            "tokens_per_s": float(lengths.sum()) / max(t_rollout, 1e-9),
        }
        if g.log_completions and _rank() == 0:
            metrics["sample"] = {"prompt": prompts[0], "completion": completions[0], "reward": rewards.total[0].item()}
        self.last_metrics = metrics
        return metrics

    # -- BaseTrainer --------------------------------------------------------------------------------
    def _resume_point(self, resume_from_checkpoint: str | None) -> Path | None:
        if resume_from_checkpoint:
            return Path(resume_from_checkpoint)
        if getattr(self.config.training, "try_resume_from_last_checkpoint", False):
            return latest_checkpoint(self.output_dir / "checkpoints")
        return None

    def train(self, resume_from_checkpoint: str | None = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        resume = self._resume_point(resume_from_checkpoint)
        if resume is not None:
            state = load_checkpoint(self.engine, resume)
            self.step, self.data_position = state["step"], state["data_position"]
            self.backend.generator.set_state(torch.tensor(state["generator_state"], dtype=torch.uint8))
        max_steps = self.config.training.max_steps
        save_steps = self.config.training.save_steps
        metrics_log = MetricsLogger(self.output_dir, enabled=_rank() == 0, tensorboard=self.config.training.enable_tensorboard)
        progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("reward {task.fields[reward]:.3f}"),
            TimeElapsedColumn(), disable=_rank() != 0,
        )
        with progress:
            task = progress.add_task("grpo", total=max_steps, completed=self.step, reward=float("nan"))
            while self.step < max_steps:
                metrics = self.grpo_step()
                if self.async_writer is not None:
                    self.async_writer.poll()
                metrics_log.log(self.step, metrics)
                progress.update(task, completed=self.step, reward=metrics["reward/mean"])
                if save_steps and self.step % save_steps == 0 and self.step < max_steps:
                    self.save_state()
        self.save_state()
        if self.async_writer is not None:
            self.async_writer.close()
        metrics_log.close()
        if self.config.training.save_final_model:
            self.save_model(self.config, final=True)
        if _rank() == 0:
            plot_curves(self.output_dir)

    def save_state(self) -> None:
        save_checkpoint(
            self.engine,
            self.output_dir / "checkpoints",
            self.step,
            {"data_position": self.data_position, "generator_state": self.backend.generator.get_state().tolist()},
            self.hf_artifacts,
            keep_last=self.config.megatron.checkpoint_config.keep_last_n_checkpoints,
            async_writer=self.async_writer,
        )

    def save_model(self, config: Any, final: bool = True) -> None:
        save_hf(self.bridge, self.engine.model, self.hf_artifacts, self.output_dir / "hf_model")

    def get_last_eval_metrics(self) -> dict[str, Any]:
        return dict(self.last_metrics)
