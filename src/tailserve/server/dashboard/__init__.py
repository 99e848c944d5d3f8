"""``GET /dashboard``: one self-contained page (HTML, CSS and JS shipped in this folder, inlined
into the response, no CDN) fed by ``GET /dashboard/events`` (see ``feed.py``)."""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def page_html() -> str:
    files = resources.files(__name__)
    html = (files / "index.html").read_text(encoding="utf-8")
    css = (files / "dashboard.css").read_text(encoding="utf-8")
    js = (files / "dashboard.js").read_text(encoding="utf-8")
    # One response: the page needs no further request that would have to carry the API key.
    return html.replace("/*DASHBOARD_CSS*/", css).replace("/*DASHBOARD_JS*/", js)
