"""Megatron-Core's local CUDA graphs (``cuda_graph_impl: local``) against the eager engine, on one GPU.

    python tests/workers/cuda_graph_worker.py WORKDIR OUT_JSON

A tiny GQA Llama, converted once (bf16), built twice from the same checkpoint with the same settings
(SDPA, fused kernels, no recompute) but ``cuda_graph_impl`` none / local (``cuda_graph_seq_length`` 40).
Each runs 4 optimizer steps whose microbatches have different lengths (all <= 40; the graph run pads
them to 40) with a masked per-token loss, and between steps a forward-only logprob pass with another
micro batch size (which must run eagerly). Records the losses, grad norms and logprobs of both runs.
The graph run also saves a checkpoint after step 2; a third engine (graphs) resumes from it and runs
steps 3-4 (RNG tracker with graph-safe generators saved and restored).
"""

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    workdir, out_json = Path(sys.argv[1]), Path(sys.argv[2])
    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.builder import build_engine
    from oumi_megatron.engine.optimizer import OptimSettings
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.engine.state.checkpointing import load_checkpoint, save_checkpoint
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron
    from oumi_megatron.engine.wrappers import unwrap
    from oumi_megatron.examples.tiny_models import build_tiny_model

    src = build_tiny_model(workdir / "hf_gqa", arch="llama", gqa=True)
    g = torch.Generator().manual_seed(5)
    steps = []
    for length in (24, 40, 17, 33):
        ids = torch.randint(0, 300, (4, length), generator=g)
        mask = torch.ones(4, length)
        mask[:, -1] = 0  # the last position has no next token
        steps.append([{"input_ids": ids[:2], "loss_mask": mask[:2]}, {"input_ids": ids[2:], "loss_mask": mask[2:]}])
    probe = torch.randint(0, 300, (3, 29), generator=g)

    def loss_fn(logprobs: torch.Tensor, batch: dict) -> tuple:
        m = batch["loss_mask"].to(logprobs.dtype)
        return -(logprobs * m).sum(), m.sum().round().to(torch.int64), {}

    def engine_for(impl: str):  # noqa: ANN202
        params = MegatronParams(micro_batch_size=2)
        params.transformer_config.recompute_granularity = None
        params.transformer_config.cuda_graph_impl = impl
        params.transformer_config.cuda_graph_seq_length = 40 if impl == "local" else None
        layout = engine_layout(params)
        ckpt = workdir / "mc_gqa"
        if not (ckpt / "oumi_megatron.json").is_file():
            convert_hf_to_megatron(src, ckpt, layout, params, dtype=torch.bfloat16)
        return build_engine(ckpt, layout, params, OptimSettings(lr=1e-3), dtype=torch.bfloat16)[1]

    runs = {}
    for impl in ("none", "local"):
        engine = engine_for(impl)
        losses, norms, probes = [], [], []
        for i, mbs in enumerate(steps):
            r = engine.train_step(mbs, loss_fn)
            losses.append(r.loss)
            norms.append(r.grad_norm)
            probes.append(engine.compute_logprobs([{"input_ids": probe}])[0][:, :-1].float())
            if impl == "local" and i == 1:
                saved = save_checkpoint(engine, workdir / "checkpoints", 2, {"step": 2}, src)
        layer = unwrap(engine.model[0]).decoder.layers[0]
        runs[impl] = {"losses": losses, "norms": norms, "probes": probes,
                      "graphed": hasattr(layer, "cudagraph_manager")}
        del engine
    engine = engine_for("local")
    load_checkpoint(engine, saved)
    resumed = [engine.train_step(mbs, loss_fn).loss for mbs in steps[2:]]
    a, b = runs["none"], runs["local"]
    result = {
        "resumed_losses": resumed,
        "resume_max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(resumed, b["losses"][2:])),
        "graphed": {"none": a["graphed"], "local": b["graphed"]},
        "losses": {"none": a["losses"], "local": b["losses"]},
        "grad_norms": {"none": a["norms"], "local": b["norms"]},
        "loss_max_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"])),
        "grad_norm_max_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(a["norms"], b["norms"])),
        "probe_logprobs_max_abs_diff": max((x - y).abs().max().item() for x, y in zip(a["probes"], b["probes"])),
        "finite": all(torch.isfinite(p).all().item() for r in (a, b) for p in r["probes"]),
    }
    out_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
