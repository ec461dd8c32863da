"""Real text available offline on any machine with CPython: the Python Language Reference
topics shipped in the standard library (pydoc_data.topics, ~465K characters of English
prose and code). Any text file can replace it (task.prompt_file)."""

from __future__ import annotations

from pathlib import Path


def python_reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def read_prompt_file(path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"task.prompt_file={path!r} does not exist (resolved to {file.resolve()})")
    return file.read_text(encoding="utf-8", errors="replace")
