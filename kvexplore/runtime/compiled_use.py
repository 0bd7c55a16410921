"""What a generator's ``compile=`` and ``kernels=`` make of its steps: the executor's compiled one-token step where
it applies, and why not where it does not (:attr:`CompiledUse.note`); the model's one-row products on the kernels
(:func:`kvexplore.fast.kernels.apply`). The one seam between the generator and the speed stack
(:mod:`kvexplore.fast`), which is imported only when one of them is asked for."""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import SettingsError
from ..models.executor import CompiledExecutor


class CompiledUse:
    """``compile``: False, True (the best mode for the device: the CPU's regional step, CUDA's reduce-overhead), or
    a mode by name ("regional" or a torch.compile mode). ``fast`` is the compiled step (None where the executor or
    cache has none, or compile=False), ``note`` why decode steps run eager although compile was asked for ("" when
    they compile); ``kernels`` whether the model's products were routed through the kernels (asked for, and they
    apply: each width on its kernel where it was timed faster than ``F.linear`` on this machine, else on
    ``F.linear``; :func:`kvexplore.fast.kernels.status` says which); ``rows``: the most rows a step feeds (a
    verification's k + 1), whose kernels are chosen and built with them."""

    def __init__(self, executor: Any, cache: Any, compile: bool | str, kernels: bool = False, rows: int = 1) -> None:
        if not isinstance(kernels, bool):
            raise SettingsError(f"kernels must be True or False, got {kernels!r}")
        if compile is not False:
            from ..fast.compiled import MODES
            if not isinstance(compile, bool) and compile not in MODES:
                raise SettingsError(f"compile must be True, False or a mode ({', '.join(MODES)}: kvexplore's "
                                    f"regional step or a torch.compile mode), got {compile!r}")
        self.note = ""
        self.fast: CompiledExecutor | None = None
        self._traced_note = False  # the message that traced steps run eager was given
        self.kernels = False
        if kernels:  # chosen (timed, or an earlier process's verdict read) and built or loaded now, not in a timed step
            from ..fast import kernels as fast_kernels
            self.kernels = fast_kernels.apply(executor.model, rows=rows)
        if compile:
            self.note = executor.compile_refusal(cache) or ""
            if self.note:
                warnings.warn(f"compile=True: {self.note}; decoding runs eager", stacklevel=3)
            else:
                self.fast = executor.compiled(cache, None if compile is True else compile)

    def runs(self, q_len: int, tracer: Any) -> bool:
        """Whether a step feeding ``q_len`` tokens under ``tracer`` runs the compiled step (one token, no tracer
        that looks inside the layers: such steps run eager, with a message once)."""
        if self.fast is None or q_len != 1:
            return False
        if self.fast.sees_inside(tracer):
            if not self._traced_note:
                warnings.warn("compile=True: a step that records attention or q/k/v runs eager (its hooks see inside "
                              "every layer); other steps run compiled", stacklevel=4)
                self._traced_note = True
            return False
        return True

    def compile_s(self, cache: Any) -> float | None:
        return None if self.fast is None else self.fast.compile_s(cache)

    def reuse_note(self, cache: Any) -> str:
        return "" if self.fast is None else self.fast.reuse_note(cache)
