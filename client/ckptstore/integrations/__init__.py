"""Framework integrations: each submodule imports its framework, this package imports none."""
