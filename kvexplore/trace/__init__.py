"""What a run leaves behind: step records, the tracer and its events, trace files, trace diffs (and where two runs
part: :mod:`.parting`), the text view."""
