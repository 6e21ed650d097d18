"""The user documentation (README.md, CHANGELOG.md, docs/, the shipped configs' comments) speaks of the product only, its
links lead somewhere, and it answers what a user asks: docs/index.md's "How do I ..." list, one SGLang install path,
every command's exit codes. (docs/benchmarks.md keeps its dated history; its headings, which other pages link to, do
not carry tracker numbers either.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

DOCS = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")])
USER_FILES = [p for p in DOCS if p.name != "benchmarks.md"] + sorted(
    p for p in (REPO / "configs").rglob("*") if p.suffix in (".yaml", ".md", ".sh", ".json"))
# how the team works, not what the product does: tracker numbers, work sessions, the machines lent to them, design
# documents outside the repository
FORBIDDEN = [
    (r"\bissues? ?#?\d+", "a tracker number"),
    (r"\bsessions?\b(?<!update session)(?<!transfer session)(?<!reload session)", "session talk"),
    (r"\blent\b", "a lent machine"),
    (r"\bseeds? ?0\d\d\b|\bseeds?/", "a design seed outside the repository"),
    (r"design doc", "a design document outside the repository"),
    (r"\.\./shared", "a folder outside the repository"),
    (r"device (tool|time)|this machine's GPU lease|no GPU this", "how the team's machines are lent"),
]


def _lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), start=1))


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_user_files_speak_of_the_product_only(path: Path) -> None:
    found = [f"{path.relative_to(REPO)}:{n}: {what}: {line.strip()[:160]}" for n, line in _lines(path)
             for pattern, what in FORBIDDEN if re.search(pattern, line, flags=re.I)]
    assert not found, "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for _, line in _lines(path):
        if line.startswith("```"):
            in_code = not in_code
        match = re.match(r"(#{1,6}) (.*)", line)
        if match and not in_code:
            slug = _slug(match.group(2))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_no_heading_carries_a_tracker_number() -> None:
    found = [f"{p.relative_to(REPO)}:{n}: {line}" for p in DOCS for n, line in _lines(p)
             if line.startswith("#") and re.search(r"\bissues? ?#?\d+|\bsession\b", line, flags=re.I)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    broken = []
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_index_answers_what_users_ask_and_a_changelog_exists() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    questions = [line for line in index.splitlines() if line.startswith("### How do I")]
    for topic in ("install", "my own model", "my own reward", "multi-turn", "LoRA", "vLLM", "SGLang", "Slurm", "SkyPilot",
                  "Ray", "rollouts", "resume", "metrics"):
        assert any(topic.lower() in q.lower() for q in questions), (topic, questions)
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog") and re.search(r"^## \[?\d+\.\d+\.\d+", changelog, flags=re.M)


def test_sglang_is_installed_one_way_everywhere() -> None:
    """One install path, the same words everywhere: the GPU lock's SGLang and its CUDA kernels beside it."""
    text = {p: p.read_text() for p in USER_FILES}
    assert not [p for p, t in text.items() if "oumi-megatron[sglang]" in t]  # not on any index
    told = [p for p, t in text.items() if re.search(r"sglang[^\n]{0,200}install|install[^\n]{0,200}sglang", t, flags=re.I)]
    assert told and all("bash scripts/setup.sh --gpu --sglang" in text[p] for p in told), told


def test_every_command_s_exit_codes_are_documented() -> None:
    from oumi_megatron.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    cli = (REPO / "docs" / "cli.md").read_text()
    for name in commands:
        section = re.search(rf"^## `oumi-megatron {re.escape(name)}`\n(.*?)(?=^## |\Z)", cli, flags=re.M | re.S)
        assert section, f"docs/cli.md has no section for {name}"
        assert re.search(r"^Exit codes?: ", section.group(1), flags=re.M), f"docs/cli.md: {name} has no exit codes"
    assert "exit" in (REPO / "README.md").read_text() and "docs/cli.md" in (REPO / "README.md").read_text()
