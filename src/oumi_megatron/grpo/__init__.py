"""The GRPO algorithm as pure tensor functions (no distributed state, no model): advantages,
clipped surrogate, KL estimators and loss aggregation. The trainer plugs ``make_grpo_loss_fn`` into
``MegatronEngine.train_step``."""
