"""White-box online RL: a GRPOFinetuner with its prompts and reward functions in the script.

    rapidlite --user-script examples/grpo_own_rewards.py --pretrained-model-name-or-path MODEL \
        --num-generations 4 --global-batch-size 16 --max-completion-length 8 --train-iters 50

The three providers, in the Rapidformer way: ``train_valid_test_datasets_provider`` returns rows (a ``prompt``,
and columns for the rewards), ``model_optimizer_lr_scheduler_provider`` is the inherited one (the flags' model
and optimizer), and ``reward_functions_provider`` returns Python functions with TRL's signature. Every
``--task grpo`` flag applies (``--loss-type``, ``--beta``, ``--num-iterations``, ...); ``RLOOFinetuner`` is the
same template for RLOO.
"""

import random

from rapidlite import GRPOFinetuner, RapidliteEngine


def correct_sum(prompts, completions, completion_ids, answer, **kwargs):
    """1 for a completion that starts with the right sum, else 0."""
    return [float(c.strip().split(" ")[0] == a) if c.strip() else 0.0 for c, a in zip(completions, answer, strict=True)]


def short(prompts, completions, completion_ids, **kwargs):
    """A little for stopping early: fewer tokens, more reward."""
    return [1.0 / (1 + len(ids)) for ids in completion_ids]


class SumsFinetuner(GRPOFinetuner):
    def train_valid_test_datasets_provider(self):
        rng = random.Random(self.args.seed)

        def rows(n):
            pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]
            return [{"prompt": f"{a} plus {b} is", "answer": str(a + b)} for a, b in pairs]

        return rows(64), rows(8), None

    def reward_functions_provider(self):
        return [correct_sum, short]


if __name__ == "__main__":
    SumsFinetuner(engine=RapidliteEngine()).train()
