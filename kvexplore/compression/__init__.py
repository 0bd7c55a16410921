"""The compression lab: what a cache that keeps less costs in quality (the continuation's log-likelihood against the
full cache) and in recall (a pass key hidden in a haystack, questions about a text)."""

from .passkey import Haystack, haystack, passkey, two_questions
from .quality import Quality, Reference, compression_quality, full_cache, full_reference

__all__ = ["Haystack", "Quality", "Reference", "compression_quality", "full_cache", "full_reference", "haystack",
           "passkey", "two_questions"]
