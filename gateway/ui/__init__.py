"""The dashboard: episodes, rewards and training, live, in a browser, at /ui on the operator surface.

Pages are rendered on the server (`html`, escaping by default; `svg`, charts), with a stylesheet and one
small script of our own (`static/`, refreshing the live parts): no build step, nothing fetched from
elsewhere. `routes` serves them behind the operator token or its session cookie (`session`); the store
reads they need are bounded (`rlgate.episodes.overview`). docs/dashboard.md describes the pages.
"""

from gateway.ui.routes import install

__all__ = ["install"]
