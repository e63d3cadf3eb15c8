"""Evaluating a causal LM on local data: multiple-choice accuracy as lm-eval scores it, and perplexity.

``data`` reads and checks the jsonl rows (``load_eval_data``), ``scoring`` computes the numbers over one
rank or many (``load_scorer``, ``evaluate``, ``multiple_choice``, ``perplexity``), ``command`` is the
``rapidlite-eval`` command. A task that evaluates a model it trained calls ``data`` and ``scoring``
directly. The package itself imports nothing, so ``rapidlite-eval --help`` does not load torch.
"""
