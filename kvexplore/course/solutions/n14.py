"""Notebook 14 (which bits go where): the bytes of llama.cpp's q4_0 cache, of KIVI at 4 bits, and of llama.cpp's
q8_0 keys with q4_0 values, scales counted."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

POSITIONS = 256


def _cache(**options):
    from ...caches.factory import make_cache
    return make_cache("quantized", tiny(), max_seq_len=POSITIONS, **options)


def _value_count() -> int:
    """Numbers a cache of POSITIONS positions stores: every layer, keys and values."""
    c = tiny().config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * POSITIONS


def _position() -> int:
    from ...caches.memory import kv_bytes
    return kv_bytes(tiny().config, 1)


def _ggml(key_bytes: int = 34, value_bytes: int = 18, layers: int | None = None) -> int:
    """Bytes of a llama.cpp cache whose key and value blocks of 32 values take ``key_bytes`` and ``value_bytes``
    (q8_0: 32 one-byte codes and a float16 scale, 34; q4_0: 16 bytes of 4-bit codes and the scale, 18)."""
    c = tiny().config
    layers = c.num_layers if layers is None else layers
    blocks = layers * c.num_kv_heads * c.head_dim * POSITIONS // 32  # blocks of keys (and as many of values)
    return blocks * (key_bytes + value_bytes)


def _kivi_parts() -> dict[str, int]:
    return _cache(bits=4).quantization.bytes_breakdown()


EXERCISES = [
    Exercise("14.1", "number", "How many bytes does a q4_0 cache of the tiny model (k_type and v_type \"q4_0\": blocks "
                               "of 32 values, 4-bit codes and one float16 scale a block) hold for max_seq_len=256?",
             unit="bytes"),
    Exercise("14.2", "number", "How many bytes does a KIVI 4-bit cache of the tiny model (bits=4: groups of 32, a "
                               "float32 scale and zero point a group, a full-precision residual window of up to "
                               "residual + group_size - 1 = 63 positions) reserve for max_seq_len=256?", unit="bytes"),
    Exercise("14.3", "number", "How many bytes does a llama.cpp cache of the tiny model with q8_0 keys and q4_0 values "
                               "(k_type=\"q8_0\", v_type=\"q4_0\": blocks of 32 values, 8-bit or 4-bit codes and "
                               "one float16 scale a block) hold for max_seq_len=256?", unit="bytes"),
]
ANSWERS = {
    "14.1": lambda: _cache(k_type="q4_0", v_type="q4_0").inspect.reserved_bytes,
    "14.2": lambda: _cache(bits=4).inspect.reserved_bytes,
    "14.3": lambda: _cache(k_type="q8_0", v_type="q4_0").inspect.reserved_bytes,
}
MISTAKES = {
    "14.1": [
        (lambda: _value_count() * 4 // 8, "the codes are not all: every block of 32 values carries a float16 scale "
                                     "(4.5 bits a value)."),
        (lambda: _value_count() * 5 // 8, "q4_0's scale is a float16 (2 bytes a block), not a float32."),
        (lambda: _value_count() * 9 // 32, "keys and values are both quantized: count both (every layer)."),
        (lambda: _value_count() * 9 // 2, "bytes, not bits: 4.5 bits a value is 9/16 of a byte."),
    ],
    "14.2": [
        (lambda: _kivi_parts()["integers"] + _kivi_parts()["scales"], "the newest tokens are held in full precision "
                                                                      "too: count the residual window's slots."),
        (lambda: _kivi_parts()["integers"] + _kivi_parts()["scales"] + 32 * _position(),
         "the residual window holds up to residual + group_size - 1 positions (a block waits to fill before it is "
         "quantized), not just residual."),
        (lambda: _kivi_parts()["integers"] + _kivi_parts()["scales"] // 2 + _kivi_parts()["residual"],
         "each group carries a zero point as well as a scale (KIVI's quantization is asymmetric)."),
        (lambda: _kivi_parts()["integers"] + _kivi_parts()["residual"], "every group of 32 codes carries a float32 "
                                                                        "scale and zero point: count them."),
    ],
    "14.3": [
        (lambda: _ggml(key_bytes=18), "the keys are q8_0: one byte a code, not half of one."),
        (lambda: _ggml(value_bytes=34), "the values are q4_0: 4-bit codes, two to a byte."),
        (lambda: _ggml(key_bytes=32, value_bytes=16), "the codes are not all: every block of 32, q8_0 or q4_0, "
                                                      "carries a float16 scale."),
        (lambda: _ggml(key_bytes=36, value_bytes=20), "llama.cpp's block scale is a float16 (2 bytes), not a "
                                                      "float32."),
        (lambda: _ggml(layers=1), "every layer has a cache of its own: multiply by the number of layers."),
    ],
}


HINTS = {
    "14.1": "count the values (2 x layers x KV heads x head_dim x positions), then 4 bits each plus a 2-byte scale per "
            "block of 32.",
    "14.2": "three parts (cache.quantization.bytes_breakdown()): the 4-bit codes of every position, a float32 scale "
            "and zero point per group of 32, and the full-precision residual window's slots.",
    "14.3": "count the blocks of 32 keys (layers x KV heads x head_dim x positions / 32) and as many of values; a q8_0 "
            "block is 32 one-byte codes and a 2-byte scale, a q4_0 block 16 bytes of codes and the scale.",
}
