"""The API's rendered Markdown (`body_html`) as Dash components, through an allow-list.

The API already escapes raw HTML; this second gate builds components only for the tags Markdown
produces and keeps only safe attributes, so nothing from a comment ever reaches the page as HTML.
"""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from dash import html

_TAGS: dict[str, Any] = {
    "p": html.P,
    "em": html.Em,
    "strong": html.Strong,
    "code": html.Code,
    "pre": html.Pre,
    "ul": html.Ul,
    "ol": html.Ol,
    "li": html.Li,
    "blockquote": html.Blockquote,
    "h1": html.H4,
    "h2": html.H4,
    "h3": html.H5,
    "h4": html.H5,
    "h5": html.H6,
    "h6": html.H6,
    "hr": html.Hr,
    "br": html.Br,
    "a": html.A,
    "table": html.Table,
    "thead": html.Thead,
    "tbody": html.Tbody,
    "tr": html.Tr,
    "th": html.Th,
    "td": html.Td,
    "del": html.Del,
    "s": html.S,
}
_VOID = {"hr", "br", "img"}
_SAFE_SCHEMES = ("http://", "https://", "mailto:", "#")


def safe_href(href: str) -> bool:
    r"""http(s), mailto, in-page anchors and paths on this server. Not protocol-relative addresses
    ('//host', '/\host': browsers read both as another host), nor any control character (browsers drop
    tabs and newlines inside URLs, so '/\t/host' is '//host')."""
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in href):
        return False
    if href.lower().startswith(_SAFE_SCHEMES):
        return True
    return href.startswith("/") and not href.startswith(("//", "/\\"))


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict[str, Any], list[Any]]] = [("root", {}, [])]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        props: dict[str, Any] = {}
        a = dict(attrs)
        if tag == "a":
            href = (a.get("href") or "").strip()
            if safe_href(href):
                props.update(href=href, rel="nofollow noopener noreferrer", target="_blank")
        if tag == "img":  # shown as its alt text and address, never loaded
            self.stack[-1][2].append(f"[image: {a.get('alt') or ''} {a.get('src') or ''}]".replace("  ", " "))
            return
        if tag in _VOID:
            if tag in _TAGS:
                self.stack[-1][2].append(_TAGS[tag]())
            return
        self.stack.append((tag, props, []))

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        # close up to the matching tag (tolerates unbalanced input)
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i][0] == tag:
                while len(self.stack) > i:
                    self._close()
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1][2].append(data)

    def _close(self) -> None:
        tag, props, children = self.stack.pop()
        factory = _TAGS.get(tag)
        node = factory(children=children, **props) if factory else html.Span(children=children)
        self.stack[-1][2].append(node)

    def result(self) -> list[Any]:
        while len(self.stack) > 1:
            self._close()
        return self.stack[0][2]


def to_components(body_html: str) -> html.Div:
    builder = _Builder()
    builder.feed(body_html)
    builder.close()
    return html.Div(builder.result(), className="markdown")
