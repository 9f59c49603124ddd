"""URLs in a topology, parsed when it is read: one that cannot be parsed would fail the run at its
first request instead (``urllib.parse`` raises on an unclosed IPv6 bracket or a bad port only
when the part is read)."""

from __future__ import annotations

import urllib.parse


def check_url(url: str, schemes: tuple[str, ...]) -> urllib.parse.SplitResult:
    """``url`` split into its parts; ``ValueError`` saying what is wrong with it (its scheme is not
    one of ``schemes``, it names no host, a part does not parse, it holds whitespace)."""
    if any(char.isspace() or not char.isprintable() for char in url):
        raise ValueError("it holds whitespace or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- parsed only when read
    except ValueError as error:
        raise ValueError(f"it does not parse ({error})") from None
    if parts.scheme not in schemes:
        raise ValueError(f"it needs a scheme: {', '.join(f'{scheme}://' for scheme in schemes)}")
    if not parts.hostname:
        raise ValueError("it names no host")
    return parts
