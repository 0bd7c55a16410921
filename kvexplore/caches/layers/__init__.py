"""One module per layer-cache class (see :mod:`kvexplore.caches.layer` for the protocol they implement)."""
