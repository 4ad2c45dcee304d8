"""FAKE CALVIN (``calvin_env``) for the adapter's contract tests; see tests/fakes/README.md."""
