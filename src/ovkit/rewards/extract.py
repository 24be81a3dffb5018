"""Find the answer in a completion: the last `<answer>...</answer>`, else the last balanced `\\boxed{...}`.

Every function here runs in time linear in the input and looks at no more than MAX_COMPLETION_CHARS characters (the
tail, since the answer comes last): no backtracking regular expressions over model output.
"""

from __future__ import annotations

import re

from ovkit.rewards.base import MAX_COMPLETION_CHARS

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
BOXED = "\\boxed{"
_BRACE_TOKENS = re.compile(r"\\boxed\{|\\[{}]|[{}]")


def tail(text: str) -> str:
    """The part of a completion that scorers look at (the answer comes last)."""
    return text[-MAX_COMPLETION_CHARS:] if len(text) > MAX_COMPLETION_CHARS else text


def last_answer_tag(text: str) -> tuple[int, int] | None:
    """Span of the content of the last closed `<answer>...</answer>`."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return start + len(ANSWER_OPEN), end


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """Content spans of every balanced `\\boxed{...}`, in order of their opening brace; one pass with a brace stack."""
    spans: list[tuple[int, int]] = []
    first = text.find(BOXED)  # braces before the first \boxed cannot close one
    if first < 0:
        return spans
    stack: list[tuple[int, bool]] = []  # (content start, opened by \boxed)
    for m in _BRACE_TOKENS.finditer(text, first):
        token = m.group()
        if token == "}":
            if stack:
                start, is_boxed = stack.pop()
                if is_boxed:
                    spans.append((start, m.start()))
        elif token == "{" or token == BOXED:
            stack.append((m.end(), token == BOXED))
        # an escaped brace (\{ or \}) is content, not structure
    spans.sort()
    return spans


def last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}` (the one that opens last), or None."""
    spans = boxed_spans(text)
    if not spans:
        return None
    start, end = spans[-1]
    return text[start:end]


def strip_think(text: str) -> str:
    """The completion without its `<think>...</think>` block (an unclosed `<think>` hides everything after it)."""
    start = text.find(THINK_OPEN)
    if start < 0:
        return text
    end = text.rfind(THINK_CLOSE)
    if end < start:
        return text[:start]
    return text[:start] + text[end + len(THINK_CLOSE) :]


def _unwrap_boxed(content: str) -> str:
    """`<answer>\\boxed{3}</answer>` -> `3`: a container that holds exactly one boxed expression."""
    s = content.strip()
    if s.startswith(BOXED) and s.endswith("}"):
        spans = boxed_spans(s)
        if spans and spans[0] == (len(BOXED), len(s) - 1):
            return s[len(BOXED) : -1].strip()
    return s


def extract_answer(text: str | None, strict: bool = False) -> str | None:
    """The answer text of a completion, stripped; None when there is none.

    strict=True: only the content of the last closed `<answer>...</answer>`.
    strict=False (default): that; else the last balanced `\\boxed{...}`; else what follows an unclosed last
    `<answer>` (a completion cut by the token limit); else the whole completion without its `<think>` block, so a
    small model that answers "3" without tags is still scored.
    """
    if not text:
        return None
    text = tail(text)
    span = last_answer_tag(text)
    if span is not None:
        return _unwrap_boxed(text[span[0] : span[1]])
    if strict:
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    opened = text.rfind(ANSWER_OPEN)
    if opened >= 0:
        rest = text[opened + len(ANSWER_OPEN) :].strip()
        return _unwrap_boxed(rest) if rest else None
    rest = strip_think(text).strip()
    return rest or None


def extract_code(text: str | None, strict: bool = False) -> str | None:
    """Source code in an answer: the answer text, or the last fenced block (```lang ... ```) inside it."""
    answer = extract_answer(text, strict=strict)
    if answer is None:
        return None
    end = answer.rfind("```")
    if end < 0:
        return answer
    start = answer.rfind("```", 0, end)
    if start < 0:  # a lone fence: code after an opening fence whose closing fence was cut off
        body = answer[end + 3 :]
    else:
        body = answer[start + 3 : end]
    newline = body.find("\n")
    if newline >= 0 and body[:newline].strip().isidentifier():
        body = body[newline + 1 :]  # drop the language tag of ```python
    return body.strip()
