"""The replay's page: the HTML around the frames (``player.html``: slider, play/pause, one section per lane, its
placeholders filled in by :func:`~.page.fragment`) and the player that decodes the frames and draws them with
plotly.js in the browser (``player.js``, after ``player_unpack.js``). It makes one ``<div class="kvx-fig
kvx-<view>">`` per view the frames name, so a view added to the registry is drawn with no change here.
"""

from __future__ import annotations

from . import assets

FRAGMENT = assets.text(__file__, "player.html")

# what every player starts with: unpack(root) (the packed plotly.js and data) and wire(...) (the slider and play)
UNPACK = assets.text(__file__, "player_unpack.js")


def on_root(body: str) -> str:
    """A page's script: a function of the page's root element, :data:`UNPACK` then ``body`` (which calls them)."""
    return "async function (root) {\n" + UNPACK + body + "}"


PLAYER = on_root(assets.text(__file__, "player.js"))
