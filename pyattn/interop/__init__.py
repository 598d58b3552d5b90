"""The boundary with users' arrays: reading them (``inputs``) and ordering with their producers (``streams``)."""
