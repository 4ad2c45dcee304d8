"""FAKE LIBERO (``libero.libero``) for the adapter's contract tests; see tests/fakes/README.md."""
