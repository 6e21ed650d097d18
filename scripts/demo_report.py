"""Summarize a finished tiny demo run: reward curve, the learning check, and generations of the export.

    python scripts/demo_report.py output/tiny_cpu_grpo [--min-rise 0.3]
"""

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("--min-rise", type=float, default=0.3)
    args = p.parse_args()
    out = Path(args.output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    blocks = [round(sum(rewards[i : i + 10]) / len(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)]
    print(f"steps: {len(rewards)}; mean reward per 10 steps: {blocks}")
    print(f"mean reward, first 5 steps: {first:.3f}; last 5 steps: {last:.3f}; rise {last - first:+.3f}")
    for name in ("megatron_checkpoint", "checkpoints", "hf_model", "metrics.jsonl", "plots/reward_mean.png", "tensorboard"):
        print(f"  {out / name}: {'ok' if (out / name).exists() else 'MISSING'}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "hf_model")
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    for ask in ("Reply with digits only. Note abc.", "Reply with letters only. Note 123."):
        chat = [{"role": "user", "content": ask}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        gen = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        print(f"  transformers greedy on hf_model: {ask!r} -> {tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)!r}")
    if last - first < args.min_rise:
        print(f"FAIL: the reward rose by {last - first:.3f} < {args.min_rise}")
        return 1
    print("OK: the policy learned from reward alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
