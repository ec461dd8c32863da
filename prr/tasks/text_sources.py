"""Real text available offline on any machine with CPython: the Python Language Reference
topics shipped in the standard library (pydoc_data.topics, ~465K characters of English
prose and code). Any text file can replace it (task.prompt_file)."""

from __future__ import annotations

import re
from pathlib import Path


def python_reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def read_prompt_file(path: str, tokens_needed: int, needed_by: str) -> str:
    """The text of task.prompt_file, refused with one line naming the file and the fix when it
    cannot be a prompt: missing, binary (a NUL byte, or not UTF-8), without text, or too short.

    tokens_needed: how many tokens the task takes from the file; needed_by: the setting(s) that
    ask for them (e.g. "task.prompt_tokens"). Every token stands for at least one byte of text,
    so a file of fewer bytes cannot hold them under any tokenizer: this is checked here, before
    the model loads. The exact token count needs the tokenizer and is checked once it loads."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise IsADirectoryError(f"task.prompt_file={path!r} is a directory; give a text file (e.g. one of its files)")
    if not file.is_file():
        what = "is not a regular file" if file.exists() else "does not exist"
        raise FileNotFoundError(f"task.prompt_file={path!r} {what} (resolved to {file.resolve()})")
    data = file.read_bytes()
    fix = "give a UTF-8 text file"
    first_nul = data.find(b"\0")
    if first_nul >= 0:  # valid UTF-8, but no text file holds NUL bytes
        raise ValueError(f"task.prompt_file={path!r} is binary, not text (a NUL byte at offset {first_nul} of "
                         f"{len(data)}); {fix}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:  # decoding it anyway would prompt the model with replacement characters
        raise ValueError(f"task.prompt_file={path!r} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                         f"{err.start} of {len(data)}); {fix}, e.g. converted with iconv -t UTF-8") from None
    if not text.strip():
        content = "is empty (0 bytes)" if not data else f"holds only whitespace ({len(data)} bytes)"
        raise ValueError(f"task.prompt_file={path!r} {content}; {needed_by} takes {tokens_needed} tokens from it: "
                         f"{fix} of at least {tokens_needed} bytes")
    if len(data) < tokens_needed:
        raise ValueError(f"task.prompt_file={path!r} holds {len(data)} bytes, too few for the {tokens_needed} tokens "
                         f"{needed_by} takes from it (a token is at least one byte of text); give a file of at least "
                         f"{tokens_needed} bytes or lower {needed_by}")
    return text


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
