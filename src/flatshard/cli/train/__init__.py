"""``flatshard train``: train the GPT or a Hugging Face model on this machine's ranks."""
