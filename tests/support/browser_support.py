"""Real-browser test support: JupyterLab and Voila on loopback, driven by Playwright for Python with Debian Chromium.

One name for the two halves, so a test imports what it needs from here:

* ``browser_servers.py``: the processes. Isolated, offline JupyterLab and Voila servers on a random loopback port
  (fresh ``JUPYTER_*`` / ``IPYTHONDIR`` folders, a temporary copy of the notebooks, a token, their own process
  group, always killed), and a Chromium that may only reach 127.0.0.1; :func:`require_browser` skips, saying how to
  fix it, where the browser stack is missing.
* ``browser_pages.py``: the pages. JupyterLab driven through ``window.jupyterapp`` (:class:`LabPage`, run all cells,
  wait for them), the Voila app opened, the explorer's plotly figures read, screenshots and timings kept.

Waits are on conditions (HTTP answers, CSS selectors, kernel status), never fixed sleeps.
"""

from __future__ import annotations

from browser_pages import (APP_READY, CLOSE_ALL, ERROR_OUTPUTS, LAB_SCROLLER, NOTEBOOK_READY, OPEN_NOTEBOOK,
                           PLOT_SIGNATURE, RENDERED_CELLS, RUN_FINISHED, UNDRAWN_TRACES, VOILA_SCROLLER, WIDGETS_S,
                           LabPage, figure, looking, new_page, open_voila_app, plot_signature, rendered_cells,
                           save_timings, screenshot, shutdown_kernel, start_run_all, tall_screenshot, token_count,
                           undrawn_traces, wait_run_finished)
from browser_servers import (CHROMIUM, CHROMIUM_ARGS, LOCAL, NOTEBOOKS, SERVER_START_S, Server, chromium, free_port,
                             isolated_env, lab_server, require_browser, voila_server)

__all__ = [
    "APP_READY", "CHROMIUM", "CHROMIUM_ARGS", "CLOSE_ALL", "ERROR_OUTPUTS", "LAB_SCROLLER", "LOCAL", "NOTEBOOKS",
    "NOTEBOOK_READY", "OPEN_NOTEBOOK", "PLOT_SIGNATURE", "RENDERED_CELLS", "RUN_FINISHED", "SERVER_START_S",
    "UNDRAWN_TRACES", "VOILA_SCROLLER", "WIDGETS_S", "LabPage", "Server", "chromium", "figure", "free_port",
    "isolated_env", "lab_server", "looking", "new_page", "open_voila_app", "plot_signature", "rendered_cells",
    "require_browser", "save_timings", "screenshot", "shutdown_kernel", "start_run_all", "tall_screenshot",
    "token_count", "undrawn_traces", "voila_server", "wait_run_finished",
]
