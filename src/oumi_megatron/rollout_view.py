"""``oumi-megatron rollouts PATH``: a run's rollout dumps (``grpo.rollout_dump_steps``) as a user reads them.

Each sample is shown as its episode: the prompt, then the completion cut into the runs of its loss mask (the policy's
turns, trained on, and the environment's observations, not trained on), with its reward, turns and whether it finished;
per-token log-probabilities on request. ``--json`` prints the selection as JSON lines (the dump's fields, where the
sample came from and its runs), ``--html OUT`` writes one self-contained page where each token is colored by its
loss mask and log-probability. The format is trainer/rollout_dump.py's.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oumi_megatron.trainer.rollout_dump import DumpFile, RolloutDumpError, find_dumps, mask_runs, read_dump


@dataclass
class Sample:
    """One dumped sample and where it came from."""

    step: int | None
    rank: int | None
    index: int
    """Its line among its file's samples (0-based)."""
    path: Path
    data: dict[str, Any]


@dataclass
class Run:
    """A run of equal loss-mask values over a completion: a policy turn or an observation."""

    policy: bool
    number: int
    """1 for the first policy turn (or observation), 2 for the second, ..."""
    start: int
    end: int
    tokens: list[str] | None
    """Each token's text (None: the dump has no per-token text and no tokenizer was given)."""
    text: str | None

    @property
    def label(self) -> str:
        kind = "policy turn" if self.policy else "observation"
        trained = "trained" if self.policy else "not trained"
        return f"{kind} {self.number} (tokens {self.start}-{self.end - 1}, {trained})"


def select(path: str | Path, step: str | None = None, rank: int | None = None, sample: int | None = None) -> tuple[list[Sample], str]:
    """The samples to show and a one-line header. ``step``: a step number, ``all``, or None for the latest dumped step;
    ``rank``: one data-parallel rank (None: all); ``sample``: one line of each selected file."""
    dumps = find_dumps(path)
    steps = sorted({d.step for d in dumps if d.step is not None})
    chosen: list[DumpFile]
    if step == "all":
        chosen = dumps
    elif step is None:
        chosen = [d for d in dumps if d.step == (steps[-1] if steps else None)]
    else:
        try:
            wanted = int(step)
        except ValueError:
            raise RolloutDumpError(f"--step {step!r}: give a step number or all.") from None
        chosen = [d for d in dumps if d.step == wanted]
        if not chosen:
            raise RolloutDumpError(f"{path} has no dump of step {wanted}; dumped steps: {_listed(steps)}.")
    if rank is not None:
        ranks = sorted({d.rank for d in chosen if d.rank is not None})
        chosen = [d for d in chosen if d.rank == rank]
        if not chosen:
            raise RolloutDumpError(f"{path}: no dump of data-parallel rank {rank} at the chosen step(s); ranks: {_listed(ranks)}.")
    samples: list[Sample] = []
    for d in chosen:
        lines = read_dump(d.path)
        if sample is not None:
            if not 0 <= sample < len(lines):
                raise RolloutDumpError(f"{d.path} has {len(lines)} samples (--sample 0 to {len(lines) - 1}), not {sample}.")
            samples.append(Sample(d.step, d.rank, sample, d.path, lines[sample]))
        else:
            samples.extend(Sample(d.step, d.rank, i, d.path, line) for i, line in enumerate(lines))
    shown = sorted({s.step for s in samples if s.step is not None})
    rewards = [s.data["reward"] for s in samples if isinstance(s.data.get("reward"), (int, float))]
    mean = f", mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
    header = (f"{len(samples)} sample(s) of step(s) {_listed(shown) or '?'}{mean} (dumped steps: {_listed(steps) or '?'}; "
              f"--step N or --step all for others)")
    return samples, header


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values)) if len(values) <= 12 else f"{', '.join(map(str, values[:5]))}, ..., {values[-1]}"


def token_texts(sample: Sample, tokenizer: Any = None) -> list[str] | None:
    """Each completion token's text: the dump's ``completion_tokens``, else decoded by ``tokenizer``, else None."""
    tokens = sample.data.get("completion_tokens")
    if tokens is not None:
        return list(tokens)
    if tokenizer is not None:
        return list(tokenizer.batch_decode([[i] for i in sample.data["completion_ids"]], skip_special_tokens=False))
    return None


def runs(sample: Sample, tokenizer: Any = None) -> list[Run]:
    """The completion's loss-mask runs with their text (a run's text is its tokens' text; a dump without per-token text
    gives the whole completion's text to its one run, and none to the runs of a multi-turn one)."""
    tokens = token_texts(sample, tokenizer)
    spans = mask_runs(sample.data)
    counts = {True: 0, False: 0}
    out = []
    for start, end, policy in spans:
        counts[policy] += 1
        piece = tokens[start:end] if tokens is not None else None
        text = "".join(piece) if piece is not None else (sample.data.get("text") if len(spans) == 1 else None)
        out.append(Run(policy, counts[policy], start, end, piece, text))
    return out


def _facts(sample: Sample) -> str:
    d = sample.data
    reward = d.get("reward")
    reward_text = f"reward {reward:.4g}" if isinstance(reward, (int, float)) else "no reward (skipped or the episode failed)"
    finished = ("finished" if d.get("finished") else f"failed: {d.get('failure')}" if d.get("status") == "failed"
                else "cut at max_completion_length")
    where = f"step {sample.step if sample.step is not None else '?'}, DP rank {sample.rank if sample.rank is not None else '?'}"
    return (f"{where}, sample {sample.index}: {reward_text}, {d.get('turns', '?')} turn(s), {finished}, "
            f"{len(d['completion_ids'])} completion tokens" + (f", generation round {d['round']}" if d.get("round") else ""))


def as_json(sample: Sample, tokenizer: Any = None) -> dict[str, Any]:
    """The dump's fields, where the sample came from, and its runs."""
    return {"step": sample.step, "rank": sample.rank, "sample": sample.index, "file": str(sample.path), **sample.data,
            "runs": [{"role": "policy" if r.policy else "observation", "turn": r.number, "start": r.start, "end": r.end,
                      "text": r.text} for r in runs(sample, tokenizer)]}


def render_text(samples: list[Sample], header: str, logprobs: bool = False, tokenizer: Any = None) -> list[Any]:
    """rich renderables, in order: the header, then each sample's facts, prompt and runs (text, never markup)."""
    from rich.text import Text

    out: list[Any] = [Text(header, style="bold")]
    missing_tokens = False
    for sample in samples:
        out.append(Text(f"── {_facts(sample)}", style="bold"))
        prompt = sample.data.get("prompt")
        out.append(Text(f"prompt ({len(sample.data['prompt_ids'])} tokens)", style="bold"))
        out.append(_indented(prompt if isinstance(prompt, str) else "(not in the dump)", "dim"))
        for run in runs(sample, tokenizer):
            out.append(Text(run.label, style="bold green" if run.policy else "bold cyan"))
            if run.text is None:
                missing_tokens = True
                out.append(_indented(f"({run.end - run.start} tokens: this dump has no per-token text)", "dim"))
            else:
                out.append(_indented(run.text, "" if run.policy else "cyan"))
            if logprobs and run.policy:
                out.append(_logprob_lines(sample, run))
    if missing_tokens:
        out.append(Text("Runs without text: the dump was written without completion_tokens; pass --tokenizer MODEL_DIR "
                        "(the run's model) to decode them.", style="yellow"))
    return out


def _indented(text: str, style: str) -> Any:
    from rich.text import Text

    lines = text.split("\n")
    return Text("\n".join(f"  │ {line}" for line in lines), style=style)


def _logprob_lines(sample: Sample, run: Run) -> Any:
    from rich.text import Text

    values = sample.data.get("logprobs")
    if values is None:
        return Text("    (no log-probabilities in this dump)", style="dim")
    ids = sample.data["completion_ids"]
    lines = []
    for i in range(run.start, run.end):
        token = repr(run.tokens[i - run.start]) if run.tokens is not None else f"id {ids[i]}"
        lp = values[i]
        lines.append(f"    {i:>5}  {token:<24}  logprob {lp:>9.4f}  p {math.exp(lp):.3f}" if lp is not None
                     else f"    {i:>5}  {token:<24}  logprob -")
    return Text("\n".join(lines), style="dim")


_HTML_HEAD = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
.sample {{ border: 1px solid #ccc; border-radius: 6px; margin: 1.5em 0; padding: 0.5em 1em; }}
.facts {{ font-weight: 600; }}
.prompt {{ background: #f4f4f4; white-space: pre-wrap; font-family: monospace; padding: 0.5em; }}
.completion {{ white-space: pre-wrap; font-family: monospace; line-height: 1.7; }}
.t {{ border-radius: 2px; }}
.obs {{ background: #dde3ea; color: #445; font-style: italic; }}
.legend span {{ padding: 0 0.4em; margin-right: 0.4em; font-family: monospace; }}
.run {{ font-size: 0.75em; color: #666; font-family: system-ui, sans-serif; }}
</style></head><body>
<h1>{title}</h1>
<p>{header}</p>
<p class="legend">policy tokens (trained), by probability under the engine:
<span style="background: hsl(0, 75%, 82%)">p 0</span><span style="background: hsl(60, 75%, 82%)">p 0.5</span>
<span style="background: hsl(120, 75%, 82%)">p 1</span>
<span class="obs">observation (not trained)</span> Hover a token for its id and log-probability.</p>
"""


def render_html(samples: list[Sample], header: str, title: str, tokenizer: Any = None) -> str:
    """One self-contained page (inline style, no script): each sample's facts, its prompt, and its completion token by
    token, policy tokens colored from red (p 0) to green (p 1) by the engine's probability, observations grey."""
    parts = [_HTML_HEAD.format(title=html.escape(title), header=html.escape(header))]
    for sample in samples:
        d = sample.data
        parts.append(f'<div class="sample"><p class="facts">{html.escape(_facts(sample))}</p>')
        prompt = d.get("prompt")
        parts.append(f'<div class="prompt">{html.escape(prompt if isinstance(prompt, str) else "(not in the dump)")}</div>')
        parts.append('<div class="completion">')
        logprobs = d.get("logprobs")
        for run in runs(sample, tokenizer):
            parts.append(f'<span class="run">[{html.escape(run.label)}]</span>')
            if run.tokens is None:
                parts.append(html.escape(run.text if run.text is not None else f"({run.end - run.start} tokens without text)"))
                continue
            for i, token in zip(range(run.start, run.end), run.tokens):
                lp = logprobs[i] if logprobs is not None else None
                tip = f"token {i}, id {d['completion_ids'][i]}" + (f", logprob {lp:.4f}, p {math.exp(lp):.3f}" if lp is not None else "")
                if not run.policy:
                    parts.append(f'<span class="t obs" title="{tip}, observation">{html.escape(token)}</span>')
                elif lp is None:
                    parts.append(f'<span class="t" title="{tip}">{html.escape(token)}</span>')
                else:
                    hue = round(120 * math.exp(lp))
                    parts.append(f'<span class="t" style="background: hsl({hue}, 75%, 82%)" title="{tip}">{html.escape(token)}</span>')
        parts.append("</div></div>")
    parts.append("</body></html>\n")
    return "".join(parts)


def load_tokenizer(name: str | None, path: str | Path) -> Any:
    """``--tokenizer`` where given; else, for a run's folder, the converted model's tokenizer where it is there
    (used only for dumps written without per-token text)."""
    from transformers import AutoTokenizer

    if name:
        return AutoTokenizer.from_pretrained(name)
    for folder in (Path(path) / "megatron_checkpoint" / "hf", Path(path) / "hf_model"):
        if (folder / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(folder))
    return None


def write_html(samples: list[Sample], header: str, out: str | Path, title: str, tokenizer: Any = None) -> Path:
    """The page at ``out``, written whole (a temporary file, renamed)."""
    import os

    out = Path(out)
    if out.parent and not out.parent.exists():
        raise RolloutDumpError(f"--html {out}: the folder {out.parent} does not exist.")
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(render_html(samples, header, title, tokenizer), encoding="utf-8")
    os.replace(tmp, out)
    return out


def json_lines(samples: list[Sample], tokenizer: Any = None) -> list[str]:
    return [json.dumps(as_json(s, tokenizer)) for s in samples]
