"""The language model a run builds, shared by ``flatshard train`` and ``flatshard plan``."""
