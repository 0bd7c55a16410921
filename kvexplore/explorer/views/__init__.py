"""The explorer's views: each a pure ``spec(records, ...) -> FigureSpec`` (see :mod:`.spec`)."""
