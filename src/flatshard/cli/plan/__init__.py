"""``flatshard plan``: peak memory, collectives and step time before launch."""
