"""The drawing layer: snapshots of a run (:mod:`.snapshot`) and the views that draw them, named in one registry
(:mod:`.registry`), served alike to the explorer widget (:mod:`.plot`), the HTML replay (:mod:`.frames`, :mod:`.page`)
and the notebook's static copy. A view registered there appears in all three (see docs/extending.md)."""
