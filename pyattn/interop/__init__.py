"""The boundary with users' arrays: reading them (``inputs``), the repeat-call key (``quick``) and
ordering with their producers (``streams``)."""
