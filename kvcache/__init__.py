"""The ``kvcache`` command line: one console script, one subcommand per role."""
