"""Rapidformer's and Megatron's globals for user scripts (``get_args``, ``get_timers``, ``get_tokenizer``,
``mpu``, ``GPTModel()`` from the flags): each reads the engine created last. Library code never imports this package."""
