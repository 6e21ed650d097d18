"""Every way the policy's weights reach a rollout engine, a module per transport, behind one interface (base.py).

The trainer hands its exporter (engine/state/hf_weights.py ``HFWeightExporter``, rollout/base.py ``PolicyWeights``) to
the backend's ``sync_weights`` / ``push_weights``; the backend built one transport at start and calls it:

- base.py: the interface (``WeightSync.sync``, ``WeightPush.push`` / ``wait``), ``WeightSyncError``, ``synced``
- in_process.py: colocated engines, the trainer's tensors in the same process (vLLM: each rank's TP shards; SGLang:
  ``update_weights_from_tensor`` buckets)
- stream.py: the NCCL / gloo stream's wire format and groups (``WeightSyncGroup``, buckets), both ends
- senders.py: who sends to engines outside the trainer's processes and how the links open; ``StreamSync``
- vllm_stream.py, vllm_worker_extension.py: the stream's receiving end inside vLLM's workers (``oumi_stream``)
- sglang_group.py: a separate SGLang engine's update group (``update_weights_from_distributed``)
- checkpoint.py: an HF folder the engines reload (``weight_sync_method: checkpoint``)
- adapter.py: the LoRA adapter alone (``lora_sync: adapter``)
- push.py: the push schedule for asynchronous engines (a host snapshot streamed behind the generations in flight)
- probe.py: did the sync reach the engine (``weight_sync/probe_max_diff``)

Modules that run inside an engine's worker processes (stream.py, vllm_stream.py, vllm_worker_extension.py) import
torch (and utils/net.py) alone at import time; this file imports nothing.
"""
