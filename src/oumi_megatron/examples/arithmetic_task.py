"""Arithmetic word problems in gsm8k's format, generated locally (no hub access needed), split by template.

Rows have gsm8k's columns, ``question`` and ``answer`` (worked steps with ``<<a+b=c>>`` annotations,
ending ``#### N``), so they load through Oumi's own ``openai/gsm8k`` dataset class (``dataset_path``)
and are scored by Oumi's ``gsm8k`` reward: the path a real gsm8k user takes, with data that exists here.

**Templates.** 48 phrasings over 8 operation structures (``KINDS``): four one-step (add, take away, times,
share equally) and four two-step (groups plus extra, pay and get change, gain then lose, a sum repeated),
six phrasings each, in different settings (money, time, distance, classrooms, farms, ...). Half of them
carry a distractor number the answer does not use (an age, a time of day, a length).

**Splits.** Two phrasings of every structure (``UNSEEN_INDEX``) are never trained on: ``eval_unseen`` asks
them, so its accuracy measures whether the model learned arithmetic word problems, not the 32 training
phrasings. ``eval_seen`` asks the training phrasings with new numbers (no question also in train), the
in-template number that a held-out split of one generator gives. The ``template`` column names each row's
phrasing (``add.3``), ``level`` its number of steps; Oumi's gsm8k class ignores both.

Every answer is a non-negative integer; divisions are exact. Numbers, names and items are drawn from a
seeded generator, so a seed gives the same files on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NAMES = ("Ava", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jack", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Sam", "Tara", "Umar", "Vera", "Yusuf")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "eggs")
Step = tuple[int, str, int, int]  # a, operator, b, result


def _add(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a, b = (rng.randint(100, 999), rng.randint(100, 999)) if big else (rng.randint(5, 60), rng.randint(3, 40))
    return {"a": a, "b": b}, [(a, "+", b, a + b)]


def _subtract(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a = rng.randint(300, 999) if big else rng.randint(20, 90)
    b = rng.randint(100 if big else 3, a - (100 if big else 5))
    return {"a": a, "b": b}, [(a, "-", b, a - b)]


def _multiply(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a, b = (rng.randint(12, 99), rng.randint(12, 99)) if big else (rng.randint(2, 9), rng.randint(3, 12))
    return {"a": a, "b": b}, [(a, "*", b, a * b)]


def _divide(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    b, q = (rng.randint(12, 49), rng.randint(12, 99)) if big else (rng.randint(2, 9), rng.randint(2, 12))
    return {"a": b * q, "b": b}, [(b * q, "/", b, q)]


def _groups_plus(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a, b, c = ((rng.randint(12, 60), rng.randint(12, 99), rng.randint(100, 999)) if big else
               (rng.randint(2, 8), rng.randint(3, 10), rng.randint(1, 15)))
    return {"a": a, "b": b, "c": c}, [(a, "*", b, a * b), (a * b, "+", c, a * b + c)]


def _pay_change(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a, b = (rng.randint(12, 40), rng.randint(12, 99)) if big else (rng.randint(2, 6), rng.randint(2, 9))
    c = a * b + (rng.randint(100, 999) if big else rng.randint(1, 25))
    return {"a": a, "b": b, "c": c}, [(a, "*", b, a * b), (c, "-", a * b, c - a * b)]


def _gain_lose(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a, b = (rng.randint(100, 900), rng.randint(100, 900)) if big else (rng.randint(10, 40), rng.randint(5, 30))
    c = rng.randint(100 if big else 2, a + b - 1)
    return {"a": a, "b": b, "c": c}, [(a, "+", b, a + b), (a + b, "-", c, a + b - c)]


def _sum_repeated(rng: random.Random, big: bool) -> tuple[dict[str, int], list[Step]]:
    a, b, c = ((rng.randint(100, 500), rng.randint(100, 500), rng.randint(12, 40)) if big else
               (rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 7)))
    return {"a": a, "b": b, "c": c}, [(a, "+", b, a + b), (a + b, "*", c, (a + b) * c)]


# Operation structure -> (numbers and worked steps, six phrasings). Slots: {name}, {item}, the numbers {a} {b}
# {c}, and {x}: a distractor number the answer does not use.
KINDS: dict[str, tuple[Callable[[random.Random, bool], tuple[dict[str, int], list[Step]]], tuple[str, ...]]] = {
    "add": (_add, (
        "{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
        "A library had {a} visitors in the morning and {b} in the afternoon. It opened at {x} o'clock. "
        "How many visitors came that day?",
        "{name} walked {a} minutes to the park and then {b} minutes to the shop. How many minutes did {name} walk in all?",
        "There are {a} red balloons and {b} blue balloons at {name}'s party, which starts at {x} o'clock. "
        "How many balloons are there?",
        "{name} scored {a} points in the first game and {b} points in the second game. What is {name}'s total score?",
        "A farmer who has {x} cows picks {a} apples on Monday and {b} apples on Tuesday. How many apples did the "
        "farmer pick?",
    )),
    "sub": (_subtract, (
        "{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?",
        "A bus had {a} passengers. At the next stop, {x} minutes later, {b} passengers got off. How many passengers "
        "are still on the bus?",
        "{name} needs {a} points to win a prize and already has {b}. How many more points does {name} need?",
        "A shop had {a} {item} on a shelf that is {x} meters long. It sold {b} of them. How many {item} are left on "
        "the shelf?",
        "{name} had ${a} and spent ${b} on lunch. How many dollars does {name} have now?",
        "A rope was {a} meters long. {name}, who is {x} years old, cut off {b} meters. How many meters long is the "
        "rope now?",
    )),
    "mul": (_multiply, (
        "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?",
        "A classroom on floor {x} has {a} rows of desks with {b} desks in each row. How many desks are in the "
        "classroom?",
        "{name} reads {b} pages every day for {a} days. How many pages does {name} read?",
        "Each of {name}'s {a} boxes holds {b} {item}, and {name} is {x} years old. How many {item} are in the boxes?",
        "Tickets to the show cost ${b} each. How many dollars do {a} tickets cost?",
        "{name} plants {a} rows of trees with {b} trees in each row. The garden has {x} benches. How many trees "
        "does {name} plant?",
    )),
    "div": (_divide, (
        "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
        "A teacher with {x} years of experience puts {a} students into {b} equal teams. How many students are on "
        "each team?",
        "{name} paid ${a} for {b} notebooks that all cost the same. How many dollars did one notebook cost?",
        "A baker bakes {a} muffins in {x} minutes and packs them in boxes of {b}. How many boxes does the baker fill?",
        "A {a} kilometer trip is split into {b} equal parts. How many kilometers long is each part?",
        "{name} has {a} {item} and puts them in piles of {b}. {name}'s brother is {x} years old. How many piles "
        "does {name} make?",
    )),
    "groups_plus": (_groups_plus, (
        "{name} puts {item} in {a} rows of {b}. There are {c} more {item} in a box. How many {item} are there in "
        "total?",
        "A store that opens at {x} o'clock sells {a} packs of pens with {b} pens in each pack, and {c} loose pens. "
        "How many pens does the store sell?",
        "{name} earns ${b} an hour for {a} hours and gets a ${c} tip. How many dollars does {name} get in all?",
        "A train has {a} cars with {b} seats each, plus {c} seats in the engine car. The train leaves at {x} o'clock. "
        "How many seats does the train have?",
        "{name} has {c} stamps and buys {a} sheets of {b} stamps each. How many stamps does {name} have now?",
        "A gardener plants {a} rows of {b} tulips and then {c} more tulips by the gate. The garden is {x} meters "
        "wide. How many tulips did the gardener plant?",
    )),
    "pay_change": (_pay_change, (
        "{name} buys {a} {item} that cost ${b} each and pays with ${c}. How many dollars of change does {name} get?",
        "A tank holds {c} liters of water. {name}, who is {x} years old, fills {a} buckets of {b} liters from it. "
        "How many liters are left in the tank?",
        "{name} had {c} stickers and gave {b} stickers to each of {a} friends. How many stickers does {name} have "
        "left?",
        "A book has {c} pages. {name} reads {b} pages a day for {a} days, starting at {x} o'clock each day. How "
        "many pages are left to read?",
        "There were {c} seats in a hall. {a} groups of {b} people sat down. How many seats are still empty?",
        "{name} saved ${c} over {x} weeks and bought {a} games at ${b} each. How many dollars does {name} have left?",
    )),
    "gain_lose": (_gain_lose, (
        "{name} has {a} {item} and buys {b} more. Then {name} gives away {c}. How many {item} does {name} have at "
        "the end?",
        "A parking lot with {x} rows has {a} cars. {b} more cars arrive and {c} cars leave. How many cars are in "
        "the lot now?",
        "{name}'s class collected {a} cans on Monday and {b} cans on Tuesday, then recycled {c} of them. How many "
        "cans are left?",
        "A baker made {a} rolls in the morning and {b} in the afternoon and sold {c}. The shop closes at {x} o'clock. "
        "How many rolls were not sold?",
        "{name} had ${a}, earned ${b} more, and then spent ${c}. How many dollars does {name} have?",
        "A pond had {a} ducks. {b} more ducks landed and then {c} flew away, {x} minutes later. How many ducks are "
        "on the pond?",
    )),
    "sum_repeated": (_sum_repeated, (
        "{name} reads {a} pages in the morning and {b} pages at night, every day for {c} days. How many pages does "
        "{name} read?",
        "Each box holds {a} red marbles and {b} blue marbles. The boxes weigh {x} kilograms. How many marbles are "
        "in {c} boxes?",
        "A runner runs {a} kilometers before lunch and {b} kilometers after lunch each day. How many kilometers does "
        "the runner run in {c} days?",
        "Every week {name}, who is {x} years old, saves ${a} from chores and ${b} from a paper route. How many "
        "dollars does {name} save in {c} weeks?",
        "A bakery packs {a} muffins and {b} cookies in each basket. How many treats are in {c} baskets?",
        "Each table at a party has {a} adults and {b} children, and the party lasts {x} hours. How many people sit "
        "at {c} tables?",
    )),
}
UNSEEN_INDEX = (2, 5)
"""The phrasings of every structure that only ``eval_unseen`` asks."""


@dataclass(frozen=True)
class Template:
    id: str
    """``kind.index``, e.g. ``add.3``."""
    kind: str
    text: str

    @property
    def unseen(self) -> bool:
        return int(self.id.rsplit(".", 1)[1]) in UNSEEN_INDEX

    @property
    def distractor(self) -> bool:
        return "{x}" in self.text


TEMPLATES: tuple[Template, ...] = tuple(Template(f"{kind}.{i}", kind, text)
                                        for kind, (_, texts) in KINDS.items() for i, text in enumerate(texts))
TRAIN_TEMPLATES = tuple(t for t in TEMPLATES if not t.unseen)
UNSEEN_TEMPLATES = tuple(t for t in TEMPLATES if t.unseen)


def make_row(template: Template, rng: random.Random, big: bool = False) -> dict:
    """One problem of ``template``: ``{"question", "answer", "level", "template"}``; ``big``: the larger numbers."""
    numbers, steps = KINDS[template.kind][0](rng, big)
    question = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), x=rng.randint(3, 12), **numbers)
    worked = [f"{a}{op}{b}=<<{a}{op}{b}={r}>>{r}." for a, op, b, r in steps]
    return {"question": question, "answer": "\n".join(worked) + f"\n#### {steps[-1][3]}", "level": len(steps),
            "template": template.id}


def make_rows(n: int, seed: int, templates: tuple[Template, ...] = TRAIN_TEMPLATES, big: bool = False) -> list[dict]:
    """``n`` rows, the templates in turn (each equally often); deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_row(templates[i % len(templates)], rng, big) for i in range(n)]


SPLIT_FILES = {"train": "arithmetic_train.jsonl", "eval_seen": "arithmetic_eval_seen.jsonl",
               "eval_unseen": "arithmetic_eval_unseen.jsonl"}
LARGE_SPLIT_FILES = {split: name.replace("arithmetic_", "arithmetic_large_") for split, name in SPLIT_FILES.items()}
"""The larger-number split (``numbers: large``): 3-digit sums and differences, 2-digit x 2-digit products, 3-4 digit
dividends, the same 48 phrasings and the same template split; a 135M model cannot do these in its head, a calculator
can (environments/calculator.py)."""


def write_splits(out_dir: str | Path, train: int = 2000, eval_: int = 200, seed: int = 0,
                 numbers: str = "small") -> dict[str, Path]:
    """``arithmetic_train.jsonl`` (training templates), ``arithmetic_eval_seen.jsonl`` (training templates, no
    question also in train) and ``arithmetic_eval_unseen.jsonl`` (the other templates) in ``out_dir``;
    ``numbers: large`` writes the ``arithmetic_large_*`` files instead."""
    if numbers not in ("small", "large"):
        raise ValueError(f"numbers must be 'small' or 'large', got {numbers!r}")
    big = numbers == "large"
    files = LARGE_SPLIT_FILES if big else SPLIT_FILES
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = {"train": make_rows(train, seed, big=big)}
    seen = {r["question"] for r in rows["train"]}
    rows["eval_seen"] = []
    attempt = 0
    while len(rows["eval_seen"]) < eval_:
        for row in make_rows(eval_, seed + 1000 + attempt, big=big):
            if row["question"] not in seen and len(rows["eval_seen"]) < eval_:
                seen.add(row["question"])
                rows["eval_seen"].append(row)
        attempt += 1
    rows["eval_unseen"] = make_rows(eval_, seed + 2000, UNSEEN_TEMPLATES, big=big)
    paths = {}
    for split, name in files.items():
        path = paths[split] = out / name
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows[split]))
        tmp.replace(path)
    return paths
