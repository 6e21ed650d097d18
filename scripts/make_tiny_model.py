"""Build a tiny random causal LM + tokenizer locally (no downloads).

    python scripts/make_tiny_model.py --out output/tiny_qwen2 [--arch qwen2|llama|qwen3]
"""

import argparse

from oumi_megatron.examples.tiny_models import ARCHITECTURES, build_tiny_model

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", default="qwen2", choices=ARCHITECTURES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build_tiny_model(args.out, arch=args.arch, seed=args.seed, num_layers=args.layers)
    print(f"tiny {args.arch} model written to {path}")
