"""The replay's page: the HTML around the frames (slider, play/pause, one section per lane) and the player that
decodes the frames and draws them with plotly.js, in the browser, with no kernel and no network.

The player makes one figure per view the frames name (``meta.views``: the registry's per-lane views in each lane's
section, the views of the whole run below), each a ``<div class="kvx-fig kvx-<view>">`` (underscores as dashes),
so a view added to the registry is drawn with no change here.

The page is ``player.html`` (``__ID__``, ``__SIDE__``, ``__TITLE__``, ``__PLOTLY__``, ``__DATA__`` and ``__PLAYER__``
filled in by :func:`~.page.fragment`); the player is ``player.js``, after ``player_unpack.js`` (:data:`UNPACK`, what
the prefix cache's players start with too).
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
