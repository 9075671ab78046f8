"""The pool and session state: ``PolyKV`` (state.py, its one writer), the ``PrefixCache`` beside it
(prefix.py), read-only reports (status.py) and the read-only view (view.py)."""
