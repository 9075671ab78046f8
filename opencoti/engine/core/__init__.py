"""The step thread's request path: ``EngineCore`` (core.py) composing the scheduler, the model runner and the
requests (requests.py), with the checks (limits.py) and speculative drafts (speculative.py)."""
