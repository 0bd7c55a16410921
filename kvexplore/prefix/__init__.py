"""Prefix sharing across requests: one page pool, a block-hash chain (vLLM's automatic prefix caching) or a radix
tree (SGLang's RadixAttention) over it, every hit counted and every miss explained; and a serving engine's own KV
cache events replayed into the same frames."""

from .frames import BlockView, MissView, PoolFrame, RequestView, TreeNode
from .policies import POLICIES, register_policy, unregister_policy
from .pool import PrefixPool, PrefixPoolFullError
from .result import Miss, ServeResult
from .tiers import Link, Offload

__all__ = ["BlockView", "Link", "Miss", "MissView", "Offload", "POLICIES", "PoolFrame", "PrefixPool",
           "PrefixPoolFullError", "RequestView", "ServeResult", "TreeNode", "register_policy", "unregister_policy"]
