"""Jobs from a config file (``hybridflow train``): checks before launch, the torchrun pool, building the
trainer from the typed config, and what a finished run directory holds."""
