"""Notebook 02 (how the cache works): the bytes of a pre-allocated cache, and its layer's write."""

from __future__ import annotations

from ..exercise import Exercise, Moment
from ..layer_check import EXERCISE as PREALLOCATED_WRITE

from ...caches.layers.preallocated_layer import PreallocatedLayer
from ...caches.memory import kv_bytes
from ..tiny import tiny

POSITIONS = 256


def _config():
    return tiny().config


def _bytes(keys_and_values: int = 2, layers: int | None = None, heads: int | None = None, size: int = 4) -> int:
    c = _config()
    layers = c.num_layers if layers is None else layers
    heads = c.num_kv_heads if heads is None else heads
    return keys_and_values * layers * heads * c.head_dim * POSITIONS * size


EXERCISES = [
    Exercise("02.1", "number", "How many bytes does a pre-allocated float32 cache of the packaged tiny model hold "
                               "for max_seq_len=256 (every layer, keys and values)?", unit="bytes"),
    Exercise("02.2", "layer", "Write the pre-allocated layer's write: copy the step's keys and values into the "
                              "buffers at their positions (narrow(2, past_len, q_len).copy_()) and return the window "
                              "attention reads."),
]
ANSWERS = {"02.1": lambda: kv_bytes(_config(), POSITIONS)}
MISTAKES = {"02.1": [
    (lambda: _bytes(keys_and_values=1), "that is half of it: a layer stores the values as well as the keys (2 "
                                        "tensors per position), and float32 takes 4 bytes a value."),
    (lambda: _bytes(layers=1), "every layer has a cache of its own: multiply by the number of layers."),
    (lambda: _bytes(heads=_config().num_heads), "the tiny model uses grouped-query attention: count the KV heads "
                                                "(config.num_kv_heads), not the query heads."),
    (lambda: _bytes() * 8, "bytes, not bits."),
]}
HINTS = {"02.1": "count 2 (keys and values) x layers x KV heads x head_dim x positions x bytes per value, from the "
                 "model's config (model.config)."}


class Reference(PreallocatedLayer):
    def write(self, step, k, v):
        past_len, q_len = step.pos, k.shape[2]
        self.prepare(step, past_len, q_len)           # counts the bytes and keeps what an undo needs
        self.k.narrow(2, past_len, q_len).copy_(k)    # in place: no allocation
        self.v.narrow(2, past_len, q_len).copy_(v)
        return self.k.narrow(2, 0, past_len + q_len), self.v.narrow(2, 0, past_len + q_len)


class _Wrong(PreallocatedLayer):
    """The solution's shape with one step done wrong: where the new keys go, which buffer gets which, the window."""

    def write(self, step, k, v):
        past_len, q_len = step.pos, k.shape[2]
        self.prepare(step, past_len, q_len)
        keys, values = self._stored(k, v)
        self.k.narrow(2, self._first_slot(past_len), q_len).copy_(keys)
        self.v.narrow(2, self._first_slot(past_len), q_len).copy_(values)
        n = self._read_length(past_len, q_len)
        return self.k.narrow(2, 0, n), self.v.narrow(2, 0, n)

    def _first_slot(self, past_len):
        return past_len

    def _stored(self, k, v):
        return k, v

    def _read_length(self, past_len, q_len):
        return past_len + q_len


class OneSlotLate(_Wrong):
    def _first_slot(self, past_len):
        return past_len + 1


class ReadsOnlyThePast(_Wrong):
    def _read_length(self, past_len, q_len):
        return max(past_len, 1)


class ReadsTheWholeBuffer(_Wrong):
    def _read_length(self, past_len, q_len):
        return self.capacity


class Swapped(_Wrong):
    def _stored(self, k, v):
        return v, k


CODE = {"02.2": PREALLOCATED_WRITE}  # how the check builds the cache from the class, and its probes (layer_check.py)
REFERENCE = {"02.2": Reference}
WRONG = {"02.2": [(OneSlotLate, "landed in slot 1: the write is 1 slot after its position"),
                  (ReadsOnlyThePast, "the new ones included"),
                  (ReadsTheWholeBuffer, "never written for this sequence"),
                  (Swapped, "the keys buffer holds the values")]}


# 02.3, predict then see: the slot the next Step writes, read from the cache map after it
def _prealloc_explorer():
    from ...explorer.widget import Explorer

    ex = Explorer("tiny", strategies=("preallocated",), max_seq_len=32, prompt="Call me Ishmael.")
    ex.run(3)
    return ex


def _written(ex) -> int:
    """The slot the last step's forward pass wrote (every layer writes the same one)."""
    (slot,) = {e.write[0] for e in ex.lanes["preallocated"].last.trace.events}
    return slot


EXERCISES.append(Exercise("02.3", "predict", "The explorer prefilled its prompt and ran 3 steps on a pre-allocated "
                                             "cache. Which slot will the next Step write?", unit="", ))
MOMENTS = {"02.3": Moment(_prealloc_explorer, _written, lambda ex: ex.lanes["preallocated"].cache.length,
                          "the cache map: the slot marked written, in every layer")}
MISTAKES["02.3"] = [
    (lambda ex: _written(ex) + 1, "a Step writes the keys and values of the token it feeds, the one the previous "
                                  "Step chose; the token it chooses now is written by the Step after."),
    (lambda ex: _written(ex) - 1, "that slot already holds the last token fed: slots count from 0, so a cache "
                                  "holding L positions writes slot L next."),
    (lambda ex: len(ex.lanes["preallocated"].history) - 1, "positions count the prompt's tokens too: the prefill "
                                                           "wrote slots 0 to the prompt's length - 1."),
]
HINTS["02.3"] = "count the slots already written in the cache map (from 0): the next Step writes the first free one."
