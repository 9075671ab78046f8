"""The pool and session state: ``PolyKV`` (state/, its one writer, split by concern), the
``PrefixCache`` beside it (prefix.py), read-only reports (status.py) and the read-only views (view.py)."""
