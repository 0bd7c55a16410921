"""The course's exercises: what each asks, of which kind, where it is in the course, and how close a number must be.
Their answers and reference solutions are in :mod:`kvexplore.course.solutions`."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SettingsError

ANSWERS = ("number", "layer")  # a compute exercise takes a number, a code exercise a layer class


@dataclass(frozen=True)
class Exercise:
    id: str            # "02.1": the notebook's number, then the exercise's
    answer_is: str     # "number" (a compute exercise) or "layer" (code: a class run through the doctor)
    question: str      # in one or two sentences, as the notebook asks it
    tolerance: float = 0.0  # compute: the largest relative difference still right (0: exact)
    unit: str = ""     # compute: what the number counts ("bytes", "pages", "tokens")

    def __post_init__(self) -> None:
        if self.answer_is not in ANSWERS:
            raise SettingsError(f"exercise {self.id}: answer_is must be one of {ANSWERS}, got {self.answer_is!r}")

    @property
    def notebook(self) -> str:
        return self.id.split(".")[0]


EXERCISES: dict[str, Exercise] = {e.id: e for e in (
    Exercise("02.1", "number", "How many bytes does a pre-allocated float32 cache of the packaged tiny model hold "
                                "for max_seq_len=256 (every layer, keys and values)?", unit="bytes"),
    Exercise("02.2", "layer", "Write the pre-allocated layer's write: copy the step's keys and values into the "
                             "buffers at their positions (narrow(2, past_len, q_len).copy_()) and return the window "
                             "attention reads."),
    Exercise("05.1", "number", "A paged cache (blocks of 16) holds a 40-token prompt; it is forked, and each of the "
                                "two sequences then writes one token. How many pages does the pool hold?",
             unit="pages"),
    Exercise("13.1", "number", "Two prompts agree on their first 45 tokens and differ at token 45. With blocks of 16, "
                                "how many of the second prompt's tokens come from the cache?", unit="tokens"),
)}


def exercises(notebook: str | None = None) -> list[Exercise]:
    """Every exercise, or a notebook's (``"02"``)."""
    return [e for e in EXERCISES.values() if notebook is None or e.notebook == notebook]


def exercise(id: str) -> Exercise:
    if id not in EXERCISES:
        raise SettingsError(f"no exercise {id!r}; the exercises are {', '.join(EXERCISES)} "
                            f"(kvexplore.course.exercises() lists them with their questions)")
    return EXERCISES[id]
