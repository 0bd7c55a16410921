"""What a run leaves behind: step records, the tracer and its events, trace files, trace diffs, the text view."""
