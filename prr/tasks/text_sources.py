"""Real text available offline on any machine with CPython: the Python Language Reference
topics shipped in the standard library (pydoc_data.topics, ~465K characters of English
prose and code). Any text file can replace it (task.prompt_file)."""

from __future__ import annotations

import re
from pathlib import Path


def python_reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def read_prompt_file(path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"task.prompt_file={path!r} does not exist (resolved to {file.resolve()})")
    return file.read_text(encoding="utf-8", errors="replace")


NOISE_SENTENCES = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]


def prose_sentences(min_words: int = 6) -> list[str]:
    """Sentences of English prose from the Python Language Reference (code lines, tables and
    fragments left out), in document order: the real-text haystack of the RULER-style tasks."""
    return _sentences(python_reference_text(), min_words)


def reference_sections() -> dict[str, list[str]]:
    """Topic name -> its prose sentences (the QA task's golden and distractor paragraphs)."""
    from pydoc_data.topics import topics

    out = {}
    for name in sorted(topics):
        sentences = _sentences(topics[name], 6)
        if sentences:
            out[name] = sentences
    return out


def _sentences(text: str, min_words: int) -> list[str]:
    out = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        if any(line.startswith(("   ", ">>>", "...", "+--", "=")) for line in lines):
            continue  # indented code, doctests, tables
        flat = " ".join(line.strip() for line in lines)
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", flat)
                if len(s.split()) >= min_words and s.endswith((".", "!", "?")) and s[0].isupper()]
    return out
