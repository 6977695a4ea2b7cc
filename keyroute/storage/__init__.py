"""Storage: what a served partition is on disk. The snapshot format and its manifests, the LMDB layout,
timelines (history and windowed stores), range reads, and how one live record changes one key.
"""
