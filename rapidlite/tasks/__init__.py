"""Black-box tasks: ordinary trainer subclasses, chosen by ``--task``."""
