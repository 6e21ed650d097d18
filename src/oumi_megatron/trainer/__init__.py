"""The GRPO training loop (OumiMegatronGrpoTrainer) and its metrics."""
