"""Durable engine state: the pool tree, named sessions and id high-water marks survive restarts.

``store``: the SQLite database of a state directory. ``kvfile``: a pool's KV on disk.
"""
