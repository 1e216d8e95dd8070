"""The ``flatshard`` command, built on the library's public surface.

``main`` (the entry point and its parser), ``train/`` (``flatshard train``: launch, restarts,
progress, checkpoints, ``--predict`` and ``--fit-memory``), ``plan/`` (``flatshard plan``),
``bench/`` (``flatshard bench``), ``ckpt`` (``flatshard ckpt``), and what train and plan
share: ``lm/`` (the language model a run builds: its options, GPT or Hugging Face, LoRA,
the corpus, the model as the planner sees it), ``config`` (options from flags and TOML),
``sizes``, ``devices``.

It imports ``flatshard``, the subpackages' surfaces (``flatshard.planner``,
``flatshard.state``, ...) and ``flatshard.models``; never a private ``_module``
(``tests/test_layers.py``).
"""
