"""vLLM's block hashes computed here from token ids, so that a stream's ``BlockStored`` hashes can be checked
against the tokens they claim (vLLM's ``prefix_caching_hash_algo="sha256_cbor"``, its reproducible choice): each
full block's hash is ``sha256(CBOR((parent hash, token ids, extra keys)))`` in canonical CBOR, and the first block's
parent is ``sha256(CBOR(seed))``, the seed being ``PYTHONHASHSEED`` where the engine had it set, else
``"vllm-none-hash"`` (vllm/utils/hashing.py and vllm/v1/core/kv_cache_utils.py, vLLM 0.32). Blocks with extra keys
(LoRA, images, cache salts) are not computed here."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

DEFAULT_SEED = "vllm-none-hash"


def _head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes([major << 5 | extra]) + value.to_bytes(size, "big")
    raise ValueError(f"{value} does not fit CBOR's 64-bit integers")


def cbor(x) -> bytes:
    """Canonical CBOR of what a block hash encodes: None, bytes, text, non-negative ints and tuples of them."""
    if x is None:
        return b"\xf6"
    if isinstance(x, bytes):
        return _head(2, len(x)) + x
    if isinstance(x, str):
        return _head(3, len(x.encode())) + x.encode()
    if isinstance(x, int) and x >= 0:
        return _head(0, x)
    if isinstance(x, tuple):
        return _head(4, len(x)) + b"".join(cbor(v) for v in x)
    raise TypeError(f"a vLLM block hash encodes None, bytes, text, non-negative ints and tuples, not {x!r}")


def vllm_block_hashes(ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED) -> list[bytes]:
    """The ``sha256_cbor`` hash of each full block of ``ids``, as vLLM names them (32 bytes each; an engine with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its default, sends the last 8 of them as an int)."""
    return vllm_chain_hashes(ids, block_size, None, seed)


def vllm_chain_hashes(ids: Sequence[int], block_size: int, parent: bytes | None, seed: str = DEFAULT_SEED
                      ) -> list[bytes]:
    """The chain continued from ``parent`` (a block's 32-byte hash) over the full blocks of ``ids``: what a
    ``BlockStored`` whose ``parent_block_hash`` is ``parent`` should announce for these tokens. ``parent=None``: a
    first block, whose parent is the seed's hash (as :func:`vllm_block_hashes`)."""
    parent, out = (hashlib.sha256(cbor(seed)).digest() if parent is None else parent), []
    for i in range(len(ids) // block_size):
        parent = hashlib.sha256(cbor((parent, tuple(int(t) for t in ids[i * block_size:(i + 1) * block_size]),
                                      None))).digest()
        out.append(parent)
    return out
