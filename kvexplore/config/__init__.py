"""A model's configuration: :class:`~.model_config.ModelConfig`, the checked fields it is read from, the registry of
architectures (:mod:`.families`, filled by :mod:`kvexplore.models.architectures`) and the plan of what each layer
keeps in its cache (:mod:`.layer_plan`)."""
