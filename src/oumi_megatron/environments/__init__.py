"""Multi-turn episodes (issue 46): environments the policy talks to between its turns, selected by name.

- base.py: what an environment is (``Environment``: start an episode from a dataset row, answer each assistant turn
  with an ``Observation`` or end it with ``EpisodeEnd``); registry.py: ``grpo.environment``'s names.
- tool_calls.py: the one tool-call format the model writes (``<tool_call>{json}</tool_call>``, the Hermes / Qwen chat
  templates' syntax) and its parser; a call that does not parse is an observation that says so, counted.
- rendering.py: an observation as token ids appended to the episode: the chat template's rendering of a ``tool``
  message after the assistant's turn, plus the next assistant header (the tokens the trainer masks from the loss).
- calculator.py: the built-in ``calculator`` environment and its safe arithmetic evaluator (``ast``, never ``eval``).
"""
