"""The engine's API: ``Engine`` (engine.py), its pool calls (pools.py), token streams, tenants' views and n > 1 choices."""
