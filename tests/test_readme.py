"""The README as a newcomer reads it, and the docs pages it links to, checked.

- Shape: at most MAX_README_LINES lines, no prose paragraph over MAX_PARAGRAPH_LINES lines, the two
  commands first, the sections in the order a reader looks for them.
- Commands: every `relaygr ...` and `./dev ...` command the README names exists, read from the
  commands' own ``--help`` (words that must be one of a command's choices are, flags are listed).
- Links: every relative link of the README and of the docs pages it owns resolves, anchors too;
  each of those pages begins by saying what it is for.
- Examples: the client examples (marked ``<!-- example: NAME -->``) run as written against the
  real broker and the real stages: RelayClient, then the JSON Schema export and confluent-kafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from relaygr.cli import COMMANDS, GROUPS, main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The docs pages the README's owner writes (others keep ARCHITECTURE.md, quality.md, device-check.md).
OWN_PAGES = [
    "configuration",
    "demo",
    "experiments",
    "integration",
    "operations",
    "reliability",
    "serving",
    "training",
]
# A page linked from the README and written with the accelerator check: checked once it exists.
MAX_README_LINES = 250
MAX_PARAGRAPH_LINES = 8
SECTIONS = [
    "What RelayGR does",
    "What the demo shows",
    "Use it from your services",
    "Run it for real",
    "Experiments and the accelerator check",
    "Where to read the code",
]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def paragraphs(text: str) -> list[tuple[int, int]]:
    """(first line, length) of every prose paragraph: a list item starts one; tables, headings
    and code blocks are not prose."""
    found: list[list[int]] = []
    previous = None
    for number, line in prose_lines(text):
        prose = line.strip() and not line.startswith(("|", "#", "<!--", "!["))
        if not prose:
            previous = None
            continue
        if previous is None or previous != number - 1 or re.match(r"(- |\d+\. )", line):
            found.append([])
        found[-1].append(number)
        previous = number
    return [(p[0], len(p)) for p in found]


def example(name: str) -> tuple[str, str]:
    """(language, code) of the fenced block right after ``<!-- example: NAME -->``."""
    match = re.search(rf"<!-- example: {name} -->\n```(\w+)\n(.*?)\n```", README.read_text(), re.S)
    assert match, f"no example marked {name!r} in the README"
    return match.group(1), match.group(2) + "\n"


def named_commands(text: str, program: str) -> list[list[str]]:
    """Every command line of ``program`` the text names, in code spans and shell blocks, split into
    words; ``a|b`` alternatives become one command each."""
    pieces = [span for _, line in prose_lines(text) for span in re.findall(r"`([^`]+)`", line)]
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang in ("bash", "sh", ""):
            pieces += [line.split(" #")[0] for line in block.splitlines()]
    commands = []
    for piece in pieces:
        for part in re.split(r"&&|;| \| ", piece):
            words = [w.strip("[]()") for w in part.split() if w not in ("...", "…")]
            if words and words[0] == program:
                commands += _expand(words)
    return commands


def _expand(words: list[str]) -> list[list[str]]:
    for i, word in enumerate(words):
        if "|" in word and not word.startswith("-"):
            return [c for alt in word.split("|") for c in _expand([*words[:i], alt, *words[i + 1 :]])]
    return [words]


def help_text(argv: list[str]) -> str | None:
    """What ``relaygr ARGV --help`` prints, or None when it does not exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            return out.getvalue() if e.code in (0, None) else None
    return None


def _choices(help_: str) -> set[str]:
    """The words a command takes as a choice: ``{a,b}`` sets and listed subcommands."""
    words = {w for group in re.findall(r"\{([\w,-]+)\}", help_) for w in group.split(",")}
    listed = help_.split("positional arguments:")[-1] if "positional arguments:" in help_ else ""
    return words | set(re.findall(r"^    ([a-z][\w-]*)\s", listed, re.M))


def command_problems(words: list[str]) -> list[str]:
    """Why ``relaygr WORDS`` is not a command of the CLI (empty when it is)."""
    name = words[1] if len(words) > 1 else ""
    if name not in COMMANDS and name not in GROUPS:
        return [f"{' '.join(words)}: no command {name!r}"]
    argv, rest = [name], words[2:]
    help_ = help_text(argv) or ""
    positional = next((w for w in rest[:1] if re.fullmatch(r"[a-z][\w-]*", w)), None)
    if positional is not None:
        if _choices(help_) and positional not in _choices(help_):
            return [f"{' '.join(words)}: {positional!r} is not one of {sorted(_choices(help_))}"]
        deeper = help_text([*argv, positional])
        if deeper and deeper != help_:  # a subcommand with options of its own
            argv, help_ = [*argv, positional], deeper
    flags = [w.split("=")[0] for w in rest if re.fullmatch(r"--?[a-z][\w-]*(=.*)?", w)]
    return [
        f"{' '.join(words)}: {flag} is not an option of relaygr {' '.join(argv)}"
        for flag in flags
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_)
    ]


def test_the_readme_is_short_and_its_paragraphs_too() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    long = [(first, n) for first, n in paragraphs(text) if n > MAX_PARAGRAPH_LINES]
    assert not long, f"paragraphs over {MAX_PARAGRAPH_LINES} lines (first line, lines): {long}"


def test_the_readme_starts_with_the_two_commands_then_its_sections_in_order() -> None:
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block and text.index(first_block.group(0)) < text.index("\n## ")
    assert [line.split()[:2] for line in first_block.group(1).splitlines()] == [
        ["./dev", "demo"],
        ["./dev", "test"],
    ]
    assert re.findall(r"^## (.+)$", text, re.M) == SECTIONS


def test_every_relaygr_command_the_readme_names_exists() -> None:
    commands = named_commands(README.read_text(), "relaygr")
    assert len(commands) >= 5, "the command parser found (almost) nothing"
    problems = [p for words in commands for p in command_problems(words)]
    assert not problems, "\n".join(problems)


def test_the_command_check_can_fail() -> None:
    assert command_problems(["relaygr", "serve"])
    assert command_problems(["relaygr", "broker", "begin"])
    assert command_problems(["relaygr", "up", "--workers", "2"])
    assert command_problems(["relaygr", "results", "get", "ID", "--no-such-flag"])
    assert not command_problems(["relaygr", "results", "get", "ID", "--wait", "30"])
    assert not command_problems(["relaygr", "bench", "device", "--out", "DIR"])


def test_every_dev_command_the_readme_names_exists() -> None:
    usage = subprocess.run(["bash", str(ROOT / "dev"), "help"], capture_output=True, text=True, check=True)
    known = set(re.findall(r"\./dev ([a-z][\w-]*)", usage.stdout))
    assert {"demo", "test"} <= known
    named = {words[1] for words in named_commands(README.read_text(), "./dev") if len(words) > 1}
    assert named and not named - known, f"./dev has no {sorted(named - known)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{name}.md" for name in OWN_PAGES)])
def test_every_relative_link_resolves(page: str) -> None:
    source = ROOT / page
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists() or (
            anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)
        ):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


@pytest.mark.parametrize("name", [*OWN_PAGES, "quality"])
def test_every_docs_page_begins_with_what_it_is_for(name: str) -> None:
    text = (DOCS / f"{name}.md").read_text()
    title, _, rest = text.partition("\n\n")
    assert title.startswith("# ")
    assert rest.startswith("This page is for"), f"docs/{name}.md: say first what the page is for"


@pytest.mark.broker
@pytest.mark.slow(seconds=30)
async def test_the_client_examples_run_as_written(kafka_settings, tmp_path, model_dir) -> None:
    """RelayClient, then the schema export and confluent-kafka, against the real stages."""
    from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
    from relaygr.infra.settings import cluster_env
    from relaygr.schemas import TopicRegistry
    from relaygr.tools.pipeline import Pipeline

    prefix = f"readme-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(
        update={"topic_prefix": prefix, "home": tmp_path / "home", "partitions": 2}
    )
    await ensure_topics(TopicRegistry(prefix, 2), settings)
    stage_env = {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_BUDGET_MS": "30000",  # no deadline misses on a loaded machine
    }
    bin_dir = str(Path(sys.executable).parent)  # `relaygr` as the README's shell block calls it
    env = {**os.environ, **cluster_env(settings), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    work = tmp_path / "work"
    work.mkdir()
    runs: dict[str, subprocess.CompletedProcess[str]] = {}
    pipe = Pipeline(settings, ranking_workers=1, env=stage_env)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        for name in ("relay-client", "schemas-export", "plain-kafka"):
            lang, code = example(name)
            argv = (
                [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
            )
            runs[name] = await asyncio.to_thread(
                subprocess.run, argv, cwd=work, env=env, capture_output=True, text=True, timeout=240
            )
            assert runs[name].returncode == 0, f"{name}:\n{runs[name].stdout}\n{runs[name].stderr}"
        pipe.check()
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)
    assert sorted(p.name for p in (work / "schemas-v1").iterdir()) == [
        "behavior.v1.schema.json",
        "dead_letter.v1.schema.json",
        "request.v1.schema.json",
        "result.v1.schema.json",
    ]
    for name in ("relay-client", "plain-kafka"):
        path, items = runs[name].stdout.strip().splitlines()[-1].split(" ", 1)
        assert path not in ("timeout", "cold_start"), runs[name].stdout
        assert len(items.strip("[]").split(",")) == 5, runs[name].stdout
