"""A line of text cut to fit a console line, a log record or a tag: whole when it fits, else
at the end of its last sentence that fits, or else between two words -- with an ellipsis that
says so -- never in the middle of a word ("...error code 2. End of")."""

from __future__ import annotations

import re

ELLIPSIS = " ..."
_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def shorten(text: str, limit: int) -> str:
    """``text`` (stripped) in at most ``limit`` characters. A sentence end is taken where it
    keeps at least half of what fits, a word boundary otherwise; a text without a space to cut
    at (a long path, a token) is cut where it must."""
    text = text.strip()
    if len(text) <= limit:
        return text
    room = max(limit - len(ELLIPSIS), 0)
    ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, room + 1) if m.end() <= room]
    if ends and ends[-1] >= room // 2:
        return text[: ends[-1]] + ELLIPSIS
    space = text.rfind(" ", 0, room + 1)
    if space > 0:
        return text[:space].rstrip(" ,;:-") + ELLIPSIS
    return text[:room] + ELLIPSIS.strip()
