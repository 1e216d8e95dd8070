"""Command-line entry points (``flatshard ...``)."""
