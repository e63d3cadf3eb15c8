"""``--task rloo``'s declaration and checks (torch-free; the trainer is ``rloo.py``): online RL
with REINFORCE Leave-One-Out's baseline, TRL's ``RLOOConfig`` names and defaults. The rollout, reward and sampling
options are GRPO's (``grpo_spec.RolloutOptions``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.sections import float_list
from rapidlite.errors import ConfigError
from rapidlite.tasks.grpo_spec import RolloutOptions, check_rollout, online_rl_task

if TYPE_CHECKING:
    from rapidlite.config.settings import Sections


@dataclass(frozen=True)
class RlooOptions(RolloutOptions):
    """RLOO's defaults (2 completions a prompt, beta 0.05, the KL in the reward) and its own options."""

    num_generations: int = flag(2, "completions sampled per prompt (a group); the batch sizes count completions")
    beta: float = flag(0.05, "the KL penalty's strength, subtracted from each completion's reward (0: no reference)")
    normalize_advantages: bool = flag(False, "standardise the advantages over the global batch")
    reward_clip_range: list[float] | None = flag(
        None, "clip each completion's weighted reward to [LOW, HIGH]", type=float_list, metavar="LOW,HIGH"
    )


def check(settings: Sections) -> None:
    check_rollout(settings, "rloo")
    clip = settings.task_options.reward_clip_range
    if clip is not None and (len(clip) != 2 or clip[0] > clip[1]):
        raise ConfigError(f"--reward-clip-range {','.join(map(str, clip))}: give LOW,HIGH with LOW <= HIGH")


TASK = online_rl_task(
    name="rloo",
    summary="online RL of AutoModelForCausalLM on prompts with reward functions (REINFORCE Leave-One-Out)",
    trainer="rapidlite.tasks.rloo:trainer_for",
    options=RlooOptions,
    check=check,
)
