"""Every command README.md shows is run, composed, or marked — and no doc link leaves the repo.

Commands are the lines of README.md's ```bash code blocks (a trailing `\\` joins lines). A
trailing comment marks a command that is not cheap:

- `# GPU...`: needs a CUDA GPU. Checked here only as far as a CPU can: its overrides must pass
  run.py's own command-line check (`prr.override_check.check_command_line`, which composes
  every job of a sweep with Hydra).
- `# slow...`: takes minutes. Here: `python run.py` lines pass the same check and, when they
  are one run, compose and pass prr's config check (`prr.config_check.validate`, the model
  described but not loaded); `make X` lines must be targets (`make -n X`). `make test-full`
  (pytest -m slow) runs them: `python run.py` lines as shown with `task.max_new_tokens=4` and,
  for the default long_text task, `task.prompt_tokens=1024` added unless they set them (outputs
  in a temporary directory); `make run` as is. `make test` and `make test-full`
  are this suite itself.
- no marker: cheap, run here as shown (≤ 60 s each); the exit code must be 0, or the N of an
  "exit N" in the comment.
- the virtual environment's lines (`python3 -m venv DIR`, `. DIR/bin/activate`): run in a
  temporary directory, where the activated shell's `python3` must be the venv's.

`$HOME/paper.txt` (the README's own-text example) is given a temporary text file.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMAND_BLOCKS = {"bash", "sh", "shell", "console"}
SUITE = {"make test", "make test-full"}


@dataclass(frozen=True)
class Command:
    text: str  # the command as shown, continuation lines joined, without its comment
    comment: str

    @property
    def is_venv(self) -> bool:
        """`python3 -m venv DIR` or `. DIR/bin/activate`: the install's virtual environment."""
        return self.text.startswith(("python3 -m venv ", ". ", "source "))

    @property
    def mark(self) -> str | None:
        head = self.comment.split(":")[0].strip().lower()
        return head if head in ("gpu", "slow") else None

    @property
    def expected_exit(self) -> int:
        found = re.search(r"exit (\d+)", self.comment)
        return int(found.group(1)) if found else 0

    def __str__(self) -> str:
        return self.text


def code_blocks(markdown: str) -> list[tuple[str, list[str]]]:
    blocks, lang, lines = [], None, []
    for line in markdown.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, lines = fence.group(1).lower(), []
        elif fence:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, "an unclosed code block in README.md"
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """The command and its trailing comment (a `#` outside quotes, after whitespace)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1 :].strip()
    return line.strip(), ""


def readme_commands(markdown: str | None = None) -> list[Command]:
    markdown = README.read_text() if markdown is None else markdown
    commands = []
    for lang, lines in code_blocks(markdown):
        if lang not in COMMAND_BLOCKS:
            continue
        pending = ""
        for line in lines:
            text, comment = split_comment(line)
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            text = (pending + text).strip()
            pending = ""
            if text:
                commands.append(Command(" ".join(text.split()), comment))
    return commands


COMMANDS = readme_commands()


def argv_of(command: Command, home: Path) -> list[str]:
    return shlex.split(command.text.replace("$HOME", str(home)))


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A stand-in for $HOME holding paper.txt: enough real text for 6000 tokens."""
    home = tmp_path_factory.mktemp("home")
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics.values())
    (home / "paper.txt").write_text(text)
    return home


def test_readme_commands_are_found_and_marked():
    assert len(COMMANDS) >= 10
    texts = [c.text for c in COMMANDS]
    assert "python run.py selector=quest predictor=ema budget=profiled" in texts  # the main command
    assert "make run" in texts and "make test" in texts
    for command in COMMANDS:
        assert command.is_venv or command.text.split()[0] in ("python", "make"), f"not a command this test knows: {command}"
        if command.mark is None:
            assert command.text not in SUITE and command.text != "make run", f"{command} is slow: mark it"
    assert not any("~" in c.text for c in COMMANDS), "bash does not expand ~ after '=': write $HOME"


def test_the_extractor_joins_lines_and_reads_markers():
    md = "```bash\npython run.py a=1 \\\n    b=2   # slow: x\nmake help\n```\n```python\nimport os  # not a command\n```\n"
    got = readme_commands(md)
    assert [(c.text, c.mark) for c in got] == [("python run.py a=1 b=2", "slow"), ("make help", None)]
    assert split_comment('python run.py x="a # b"  # GPU') == ('python run.py x="a # b"', "GPU")


def test_cheap_commands_run(home):
    """All at once (each pays Python's and torch's start-up), one test item."""
    cheap = [c for c in COMMANDS if c.mark is None and not c.is_venv]
    running = []
    for command in cheap:
        argv = argv_of(command, home)
        if argv[0] == "python":
            argv[0] = sys.executable
        running.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    problems = []
    for command, proc in zip(cheap, running, strict=True):
        out, err = proc.communicate(timeout=60)
        if proc.returncode != command.expected_exit:
            problems.append(f"{command}: exit {proc.returncode}, expected {command.expected_exit}: {out[-1000:]}{err[-1000:]}")
        elif command.expected_exit == 2 and ("Traceback" in err or len(err.strip().splitlines()) != 1):
            problems.append(f"{command}: a refusal is one line on stderr, no traceback: {err[-1000:]}")
    assert not problems, "\n".join(problems)


def test_the_venv_lines_make_a_venv_whose_python_the_shell_then_runs(tmp_path):
    """README's venv lines, in order, in one shell in a temporary directory (not the repo):
    afterwards `python3` is the venv's, which is what the Makefile then installs into."""
    lines = [c.text for c in COMMANDS if c.is_venv]
    assert len(lines) == 2 and lines[0].startswith("python3 -m venv ") and lines[1].endswith("/bin/activate"), lines
    script = " && ".join([*lines, "command -v python3", 'python3 -c "import sys; print(sys.prefix)"'])
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    venv = (tmp_path / lines[0].split()[-1]).resolve()
    found, prefix = done.stdout.split()
    assert Path(found).parent == venv / "bin" and Path(prefix).resolve() == venv, done.stdout


def run_py_overrides(command: Command, home: Path) -> list[str]:
    argv = argv_of(command, home)
    assert argv[:2] == ["python", "run.py"], command
    return argv[2:]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.mark and c.text.startswith("python run.py")], ids=str)
def test_marked_run_commands_compose(command, home):
    from hydra import compose, initialize_config_dir

    from prr.config_check import validate
    from prr.override_check import check_command_line

    overrides = run_py_overrides(command, home)
    check_command_line(overrides, ROOT / "conf", "config")  # raises BadOverride: what run.py refuses
    if command.mark == "gpu" or "-m" in overrides or "--multirun" in overrides:
        return  # a sweep's jobs were each composed by the check; a GPU config does not validate on a CPU
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra")])
    validate(cfg)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.text.startswith("make") and c.text not in SUITE], ids=str)
def test_make_targets_exist(command):
    done = subprocess.run(["make", "-n", *command.text.split()[1:]], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if c.mark == "slow" and c.text not in SUITE], ids=str)
def test_slow_commands_run(command, home, tmp_path):
    if command.text.startswith("make"):
        stamp = subprocess.run(["make", "-s", "print-test-stamp", f"PYTHON={sys.executable}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        installed = subprocess.run(["make", "-q", stamp, f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                                   timeout=30)
        if installed.returncode != 0:  # make would (re)install first: not a test's business
            pytest.skip("the install is not up to date: run make install first")
        argv, cwd = command.text.split(), ROOT
    else:
        overrides = run_py_overrides(command, home)
        keys = {o.lstrip("+").split("=")[0] for o in overrides}
        overrides += [] if "task.max_new_tokens" in keys else ["task.max_new_tokens=4"]
        if "task" not in keys and "task.prompt_tokens" not in keys:  # long_text: a shorter prefill
            overrides.append("task.prompt_tokens=1024")
            if "selector=indexer" in overrides and "selector.topk_tokens" not in keys:  # (2048 would be dense)
                overrides.append("selector.topk_tokens=256")
        argv, cwd = [sys.executable, str(ROOT / "run.py"), *overrides], tmp_path  # outputs/, multirun/ there
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=3600)
    assert done.returncode == command.expected_exit, done.stdout[-3000:] + done.stderr[-3000:]


# -- links ---------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return found


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(path):
    text = "\n".join(line for line in path.read_text().splitlines())
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            problems.append(f"{target}: links outside the repository")
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if ROOT not in linked.parents and linked != ROOT:
            problems.append(f"{target}: outside the repository")
        elif not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not problems, f"{path.name}: " + "; ".join(problems)
    assert "../shared" not in path.read_text(), "the repository must be self-contained"
