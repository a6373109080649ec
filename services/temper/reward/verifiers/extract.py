"""Answer extraction from model output: \\boxed{...}, <tag>...</tag>, fenced code blocks.

Every function returns None when the output holds no such answer, so a caller can tell "no
answer" (a format failure) from "a wrong answer".
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FENCE = re.compile(r"^```[ \t]*([A-Za-z0-9_+#.-]*)[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if none closes."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                continue  # an escaped brace is content: \{1, 2\} is a set
            if c == "{" and text[i - 1] != "\\":
                depth += 1
            elif c == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def tagged(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>``, stripped."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def think_then_answer(text: str) -> bool:
    """Exactly one ``<think>...</think>`` followed by exactly one ``<answer>...</answer>``, nothing after it."""
    return re.fullmatch(r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*",
                        text, flags=re.DOTALL) is not None


def code_block(text: str, languages: tuple[str, ...] = ()) -> str | None:
    """The last fenced code block whose info string is one of ``languages`` (or empty)."""
    wanted = {lang.lower() for lang in languages}
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    for lang, body in reversed(blocks):
        if not lang or not wanted or lang in wanted:
            return body
    return None
