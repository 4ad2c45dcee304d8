"""FAKE ``libero.libero``: ``get_libero_path`` (LIBERO's ``libero/libero/__init__.py``), without the first-import
prompt. Only the ``bddl_files`` key is served."""

from __future__ import annotations

import os


def get_libero_path(query_key: str) -> str:
    assert query_key == "bddl_files", f"the fake serves only bddl_files, not {query_key}"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bddl_files")
