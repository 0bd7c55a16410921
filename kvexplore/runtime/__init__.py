"""Running a model on a cache: the :class:`~.generator.Generator`, sampling, the compiled step's use, perplexity."""
