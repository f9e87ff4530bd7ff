"""Subpackage of dasktrain (its re-exports follow in the next commit)."""
