"""What every other folder may use and that knows nothing of models: argument checks (:mod:`.settings`), the
device-to-host transfers (:mod:`.host`), the allocator's counters (:mod:`.allocator`) and the hook helper."""
