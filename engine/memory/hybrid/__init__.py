"""Hybrid models' KV memory: the sliding layers' local pages and the manager over them."""
