"""The GRPO algorithm as pure tensor functions (no distributed state, no model): advantages,
clipped surrogate, KL estimators and loss aggregation. The trainer plugs ``make_grpo_loss_fn`` into
``MegatronEngine.train_step``."""

from oumi_megatron.grpo import algorithm as _builtins  # noqa: E402,F401 - registers the built-in losses / estimators
