"""Example content, outside the core: the CPU demo's task (a ``grpo.plugins`` module), the arithmetic word-problem
task, GGUF loading for the bundled SmolLM2 and the tiny local models of tests and demos. Nothing in the core
imports these; configs name the demo task through ``grpo.plugins`` and the CLI's data commands import them."""
