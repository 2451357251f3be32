"""A tensor-parallel serving loop over kvmgr's rank processes (docs/guides/tensor-parallel.md)."""
