"""The executor contract under the name users import it by (``from kvexplore.runtime.executor import Executor``):
it is defined in :mod:`kvexplore.models.executor`, below the speed stack (:mod:`kvexplore.fast`), which implements
it, and the generator, which drives it."""

from ..models.executor import (ADAPTERS, CompiledExecutor, Executor, as_executor, register_adapter,  # noqa: F401
                               unregister_adapter)
