"""Arithmetic word problems in gsm8k's format, generated locally (no hub access needed).

Rows have gsm8k's columns, ``question`` and ``answer`` (worked steps with ``<<a+b=c>>`` annotations,
ending ``#### N``), so they load through Oumi's own ``openai/gsm8k`` dataset class (``dataset_path``)
and are scored by Oumi's ``gsm8k`` reward: the path a real gsm8k user takes, with data that exists here.

Difficulty levels (the ``level`` column, kept for per-level analysis; the gsm8k class ignores it):
1. one operation on small numbers (add, take away, times, share equally);
2. two operations (buy items and pay, earn and spend, groups plus extra);
3. three operations (a day of trades; price, discount and change).
Every answer is a non-negative integer; divisions are exact. Templates and names are drawn from a seeded
generator, so a seed gives the same file on every machine; train and eval use different seeds and
no eval question appears in train (checked when writing).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Ava", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jack", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Sam", "Tara", "Umar", "Vera", "Yusuf")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "eggs")
Problem = tuple[str, list[str], int]  # question, worked steps, answer


def _step(text: str, a: int, op: str, b: int, result: int) -> str:
    """A gsm8k worked step: ``text`` mentions the result; the calculator annotation shows the operation."""
    return f"{text.format(calc=f'{a}{op}{b}=<<{a}{op}{b}={result}>>{result}')}"


def _add(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(5, 60), rng.randint(3, 40)
    q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    return q, [_step(f"{name} has {{calc}} {item}.", a, "+", b, a + b)], a + b


def _subtract(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(20, 90)
    b = rng.randint(3, a - 5)
    q = f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?"
    return q, [_step(f"{name} has {{calc}} {item} left.", a, "-", b, a - b)], a - b


def _multiply(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per = rng.randint(2, 9), rng.randint(3, 12)
    q = f"{name} buys {boxes} bags with {per} {item} in each bag. How many {item} does {name} buy?"
    return q, [_step(f"{name} buys {{calc}} {item}.", boxes, "*", per, boxes * per)], boxes * per


def _share(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 12)
    total = friends * each
    q = f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
    return q, [_step(f"Each friend gets {{calc}} {item}.", total, "/", friends, each)], each


def _buy_and_pay(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 9)
    cost = count * price
    paid = cost + rng.randint(1, 20)
    q = (f"{name} buys {count} {item} that cost ${price} each and pays with ${paid}. "
         f"How many dollars of change does {name} get?")
    steps = [_step(f"The {item} cost {{calc}} dollars.", count, "*", price, cost),
             _step(f"The change is {{calc}} dollars.", paid, "-", cost, paid - cost)]
    return q, steps, paid - cost


def _earn_and_spend(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    days, rate = rng.randint(2, 7), rng.randint(5, 15)
    earned = days * rate
    spent = rng.randint(3, earned - 1)
    q = (f"{name} earns ${rate} a day for {days} days and then spends ${spent} on a game. "
         f"How many dollars does {name} have left?")
    steps = [_step(f"{name} earns {{calc}} dollars.", days, "*", rate, earned),
             _step(f"{name} has {{calc}} dollars left.", earned, "-", spent, earned - spent)]
    return q, steps, earned - spent


def _groups_plus(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    rows, per, extra = rng.randint(2, 8), rng.randint(3, 10), rng.randint(1, 15)
    grid = rows * per
    q = (f"{name} puts {item} in {rows} rows of {per}. There are {extra} more {item} in a box. "
         f"How many {item} are there in total?")
    steps = [_step(f"The rows hold {{calc}} {item}.", rows, "*", per, grid),
             _step(f"In total there are {{calc}} {item}.", grid, "+", extra, grid + extra)]
    return q, steps, grid + extra


def _trading_day(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, bought, sold_to_each, buyers = rng.randint(10, 40), rng.randint(5, 30), rng.randint(2, 5), rng.randint(2, 4)
    after_buy = start + bought
    sold = sold_to_each * buyers
    q = (f"{name} has {start} {item} and buys {bought} more. Then {name} sells {sold_to_each} {item} to each of "
         f"{buyers} neighbours. How many {item} does {name} have at the end?")
    steps = [_step(f"After buying, {name} has {{calc}} {item}.", start, "+", bought, after_buy),
             _step(f"{name} sells {{calc}} {item}.", sold_to_each, "*", buyers, sold),
             _step(f"At the end {name} has {{calc}} {item}.", after_buy, "-", sold, after_buy - sold)]
    return q, steps, after_buy - sold


def _discount_and_change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 6), rng.randint(4, 10)
    full = count * price
    discount = rng.randint(1, full // 3)
    paid = ((full - discount) // 10 + 1) * 10 + rng.choice((0, 10))
    q = (f"{count} packs of {item} cost ${price} each. {name} gets ${discount} off the total and pays with "
         f"${paid}. How many dollars of change does {name} get?")
    steps = [_step("The packs cost {calc} dollars.", count, "*", price, full),
             _step("With the discount that is {calc} dollars.", full, "-", discount, full - discount),
             _step("The change is {calc} dollars.", paid, "-", full - discount, paid - (full - discount))]
    return q, steps, paid - (full - discount)


LEVELS: dict[int, tuple[Callable[[random.Random], Problem], ...]] = {
    1: (_add, _subtract, _multiply, _share),
    2: (_buy_and_pay, _earn_and_spend, _groups_plus),
    3: (_trading_day, _discount_and_change),
}


def make_rows(n: int, seed: int, levels: tuple[int, ...] = (1, 2, 3)) -> list[dict]:
    """``n`` rows ``{"question", "answer", "level"}``, levels in turn; deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        level = levels[i % len(levels)]
        question, steps, answer = rng.choice(LEVELS[level])(rng)
        rows.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}", "level": level})
    return rows


def write_splits(out_dir: str | Path, train: int = 2000, eval_: int = 200, levels: tuple[int, ...] = (1, 2, 3),
                 seed: int = 0) -> tuple[Path, Path]:
    """``arithmetic_train.jsonl`` and ``arithmetic_eval.jsonl`` in ``out_dir``; eval questions that also
    occur in train are replaced, so the eval split is held out."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_rows = make_rows(train, seed, levels)
    seen = {r["question"] for r in train_rows}
    eval_rows: list[dict] = []
    attempt = 0
    while len(eval_rows) < eval_:
        for row in make_rows(eval_, seed + 1000 + attempt, levels):
            if row["question"] not in seen and len(eval_rows) < eval_:
                seen.add(row["question"])
                eval_rows.append(row)
        attempt += 1
    paths = out / "arithmetic_train.jsonl", out / "arithmetic_eval.jsonl"
    for path, rows in zip(paths, (train_rows, eval_rows)):
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return paths
