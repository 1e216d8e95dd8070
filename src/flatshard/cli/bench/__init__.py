"""``flatshard bench``: flatshard against FSDP2, DDP and no communication, side by side."""
