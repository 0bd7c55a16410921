"""The speculation lab: drafts checked by the target model in one pass, rejected drafts taken back from the cache
(speculative decoding, prompt lookup, a smaller model or the first layers as the drafter). A ``Generator(draft=...)``
loads it."""

from .drafters import DRAFTERS, Draft, Drafter, ModelDrafter, PromptLookup, make_drafter, register_drafter, \
    unregister_drafter
from .speculative import Speculation, Undo, Verification, accept, back_to

__all__ = ["DRAFTERS", "Draft", "Drafter", "ModelDrafter", "PromptLookup", "Speculation", "Undo", "Verification",
           "accept", "back_to", "make_drafter", "register_drafter", "unregister_drafter"]
