"""A model's configuration: :class:`~.model_config.ModelConfig`, the checked fields it is read from, and the plan of
what each layer keeps in its cache (:mod:`.layer_plan`)."""
