"""Black-box tasks, chosen by ``--task``: per task its trainer (``<name>.py``, an ordinary trainer subclass), its
declaration (``<name>_spec.py``: its TaskSpec, options and checks, torch-free; the registry finds it) and its demo."""
