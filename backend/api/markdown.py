"""Markdown to safe HTML: raw HTML is escaped (never passed through), unsafe link schemes are dropped."""

from __future__ import annotations

from markdown_it import MarkdownIt

# commonmark preset: maxNesting 20 bounds deeply nested input; html=False escapes <script> and any tag.
_md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False}).enable(
    ["table", "strikethrough"]
)


def _link_open(self, tokens, idx, options, env):
    tokens[idx].attrSet("rel", "nofollow noopener noreferrer")
    return self.renderToken(tokens, idx, options, env)


_md.add_render_rule("link_open", _link_open)


def render(body: str) -> str:
    return _md.render(body)
