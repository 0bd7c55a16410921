"""Reading an exported replay page in headless Chromium, opened from disk with the network blocked: what the replay
tests (test_replay_browser.py, test_bugs_browser.py) share."""

from __future__ import annotations

import numpy as np

ROOT = "document.querySelector('.kvx-replay')"


def same(a, b) -> bool:
    """A figure's array as the page holds it (None for a gap) equals the kernel's, within float32 rounding."""
    a = np.asarray([np.nan if v is None else v for v in np.asarray(a, dtype=object).ravel()], dtype=float)
    b = np.asarray(b, dtype=float).ravel()
    return a.shape == b.shape and np.allclose(a, b, equal_nan=True, atol=1e-6)


def open_replay(page, path, requests: list[str]) -> None:
    """Open the replay at ``path`` in ``page`` with every request but the file itself blocked (and appended to
    ``requests``), and wait until it has drawn; it must not report an error."""

    def route(r):
        if not r.request.url.startswith("file:"):
            requests.append(r.request.url)
            return r.abort()
        return r.continue_()

    page.route("**/*", route)
    page.goto(path.as_uri())
    page.wait_for_function(f"{ROOT}.dataset.kvxReady === '1' || !!{ROOT}.dataset.kvxError", timeout=120_000)
    assert page.evaluate(f"{ROOT}.dataset.kvxError") is None


def slide(page, step: int) -> None:
    """Move the replay's slider to ``step`` and wait until the page has drawn it."""
    page.evaluate("(i) => { const s = document.querySelector('.kvx-replay .kvx-slider'); "
                  "s.value = String(i); s.dispatchEvent(new Event('input')); }", step)
    page.wait_for_function(f"{ROOT}.dataset.kvxStep === '{step}'", timeout=30_000)


def shown(record) -> str:
    """How the token strip writes a record's token (spaces, tabs and newlines made visible)."""
    return record.text.replace(" ", "·").replace("\t", "→").replace("\n", "↵\n") or "∅"
