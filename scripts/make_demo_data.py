"""Generate the tiny demo's synthetic prompts (data/char_class_{train,eval}.jsonl). Deterministic.

Each row asks for one character class; the demo's reward is the fraction of the completion's
characters that belong to that class. See README ("The demo task") for why a tiny model can learn it.

    python scripts/make_demo_data.py
"""

import json
import random
from pathlib import Path

CLASSES = ("digits", "letters")
TEMPLATES = (
    "Reply with {cls} only. Note {noise}.",
    "Write some {cls}. Context: {noise}.",
    "Only {cls}, please ({noise}).",
)


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        cls = CLASSES[i % len(CLASSES)]
        noise = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(rng.randint(3, 10)))
        rows.append({"prompt": rng.choice(TEMPLATES).format(cls=cls, noise=noise.strip() or "x"), "target": cls})
    return rows


if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "data"
    out.mkdir(exist_ok=True)
    for split, n, seed in (("train", 512, 0), ("eval", 64, 1)):
        path = out / f"char_class_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in make_rows(n, seed)))
        print(f"wrote {n} rows to {path}")
