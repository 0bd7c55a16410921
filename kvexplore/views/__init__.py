"""The drawing layer: snapshots of a run and the views that draw them, served alike to the explorer widget, the
HTML replay and the notebook's static copy (:mod:`.registry`)."""
