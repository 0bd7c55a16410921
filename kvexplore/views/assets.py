"""The widgets' and pages' JavaScript, HTML and CSS: real files beside the module that uses them (``plot_figure.js``
beside ``plot.py``), package data listed in pyproject.toml, found and read here. An anywidget takes its module as
the file (:func:`path`); what goes into a page's text, or is joined with other code, is read once, at import
(:func:`text`). tests/screen/test_assets.py checks that every file named exists and is packaged."""

from __future__ import annotations

from pathlib import Path


def path(module: str, name: str) -> Path:
    """The file ``name`` beside the module whose ``__file__`` is ``module``; :func:`text` reads it."""
    return Path(module).with_name(name)


def text(module: str, name: str) -> str:
    return path(module, name).read_text(encoding="utf-8")
