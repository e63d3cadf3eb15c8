"""``--task grpo``'s declaration and checks (torch-free; the trainer is ``grpo.py``), and the options online RL
shares with ``--task rloo`` (``RolloutOptions``): the rewards, the sampling, the rollout's reuse and the clip.

TRL's names and defaults throughout (``GRPOConfig``). ``--micro-batch-size`` and ``--global-batch-size`` count
completions, as TRL's batch sizes do: a global batch of 32 with ``--num-generations 8`` is 4 prompts, each
sampled 8 times.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapidlite.config.fields import flag
from rapidlite.config.sections import float_list, text_list
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")  # rapidlite.tasks.rl_losses implements them
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
REWARD_SPEC = "file.py:function, package.module:function, or a directory holding a one-label reward model"
# The shared flags online RL does not read: one set is refused in one line.
IGNORED = (
    "seq_length",  # a sequence is --max-prompt-length + --max-completion-length
    "precompute_ref_logprobs",
    "packing",
    "padding_free",
    "group_by_length",
    "streaming",
    "prompt_template",
    "eval_generate",
    "eval_harness",
)


@dataclass(frozen=True)
class RolloutOptions:
    """What ``--task grpo`` and ``rloo`` share: the reward functions, how completions are sampled, how often a
    rollout is trained on, the ratio's clip and the KL strength."""

    reward_funcs: list[str] | None = flag(
        None, f"reward functions, SPEC[,SPEC...]: each a {REWARD_SPEC}", type=text_list, metavar="SPEC[,SPEC...]"
    )
    reward_weights: list[float] | None = flag(
        None, "one weight per reward function (default: 1 each)", type=float_list, metavar="W[,W...]"
    )
    num_generations: int = flag(8, "completions sampled per prompt (a group); the batch sizes count completions")
    max_completion_length: int = flag(512, "tokens sampled per completion at most")
    temperature: float = flag(1.0, "sampling temperature (the log-probabilities are scored at it too)")
    top_p: float = flag(1.0, "nucleus sampling: the smallest set of tokens holding this probability")
    top_k: int = flag(0, "sample among the k most likely tokens (0: all)")
    min_p: float | None = flag(None, "drop tokens below this share of the most likely one's probability")
    repetition_penalty: float = flag(1.0, "divide the logits of tokens already in the prompt or completion (>1)")
    generation_batch_size: int | None = flag(
        None, "completions sampled together in one forward (default: all of the rank's share of the global batch)"
    )
    num_iterations: int = flag(1, "optimizer steps on each rollout (mu; the rollout's log-probabilities kept)")
    epsilon: float = flag(0.2, "the importance ratio's clip below (and above, without --epsilon-high)")
    epsilon_high: float | None = flag(None, "the ratio's clip above (DAPO's clip-higher; default --epsilon)")
    mask_truncated_completions: bool = flag(
        False, "a completion cut at --max-completion-length neither trains nor counts"
    )
    beta: float = flag(0.0, "the KL penalty's strength (at 0 no reference model is loaded)")
    use_vllm: bool = flag(False, "sample with vLLM colocated on the GPU (needs vllm and CUDA; not run here yet)")
    vllm_gpu_memory_utilization: float = flag(0.3, "--use-vllm: the share of the GPU's memory vLLM takes")


@dataclass(frozen=True)
class GrpoOptions(RolloutOptions):
    """GRPO's loss: how it is normalised, the importance ratio's level, the rewards' scaling and two-sided
    clipping."""

    loss_type: str = flag(
        "dapo",
        "grpo (each completion's token mean), dapo (the global batch's token mean), dr_grpo (over completions x "
        "--max-completion-length) or bnpo (each micro-batch's token mean)",
        choices=LOSS_TYPES,
    )
    importance_sampling_level: str = flag(
        "token", "token (GRPO) or sequence (GSPO: one ratio per completion)", choices=IMPORTANCE_SAMPLING_LEVELS
    )
    scale_rewards: str = flag(
        "group", "divide the advantages by the group's, the batch's or no standard deviation", choices=SCALE_REWARDS
    )
    delta: float | None = flag(None, "two-sided clipping: the unclipped ratio capped at this (> 1 + --epsilon)")
    use_bias_correction_kl: bool = flag(
        True, "the KL estimate times the importance ratio (its gradient is the reverse KL's)", negatable=True
    )


def online_reference(settings: Sections) -> str:
    """The reference model: "none" at ``--beta 0``, else "adapters" with ``--lora-rank`` (the policy with its
    adapters disabled) or "copy" (a frozen copy laid out as the policy)."""
    if settings.task_options.beta == 0.0:
        return "none"
    return "adapters" if settings.lora.lora_rank else "copy"


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"--{name.replace('_', '-')} {value}: must be positive")


def check_rollout(settings: Sections, task: str) -> None:
    """The checks ``grpo`` and ``rloo`` share (the batch sizes count completions)."""
    o: RolloutOptions = settings.task_options
    if o.num_generations < 2:
        raise ConfigError(
            f"--num-generations {o.num_generations}: --task {task} compares the completions of one prompt with each "
            "other; give 2 or more"
        )
    batch = settings.batching.global_batch_size
    if batch % o.num_generations:
        prompts = max(batch // o.num_generations, 1)
        raise ConfigError(
            f"--global-batch-size {batch} is not a multiple of --num-generations {o.num_generations}: the batch sizes "
            f"count completions (e.g. --global-batch-size {prompts * o.num_generations}: {prompts} prompts x "
            f"{o.num_generations})"
        )
    if o.reward_weights is not None and o.reward_funcs is not None and len(o.reward_weights) != len(o.reward_funcs):
        raise ConfigError(
            f"--reward-weights: {len(o.reward_weights)} weights for {len(o.reward_funcs)} reward functions; give one "
            "weight per function"
        )
    for name in ("max_completion_length", "temperature", "top_p", "repetition_penalty", "generation_batch_size"):
        _positive(name, getattr(o, name))
    for name in ("num_iterations", "epsilon", "epsilon_high"):
        _positive(name, getattr(o, name))
    if o.top_p > 1:
        raise ConfigError(f"--top-p {o.top_p}: must be in (0, 1]")
    if o.top_k < 0:
        raise ConfigError(f"--top-k {o.top_k}: must be >= 0 (0: off)")
    if o.min_p is not None and not 0 <= o.min_p <= 1:
        raise ConfigError(f"--min-p {o.min_p}: must be in [0, 1]")
    if o.beta < 0:
        raise ConfigError(f"--beta {o.beta}: must be >= 0 (0: no KL term and no reference model)")
    if not 0 < o.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm-gpu-memory-utilization {o.vllm_gpu_memory_utilization}: must be in (0, 1]")
    if o.use_vllm:
        if settings.topology.cp > 1:
            raise ConfigError(
                f"--use-vllm with --context-parallel-size {settings.topology.cp}: not built; sample with the "
                "training model (drop --use-vllm), which samples whole sequences and trains their shards"
            )
        check_vllm()


def check_vllm() -> None:
    """``--use-vllm``: vLLM installed and a CUDA device present, else one line."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "--use-vllm: vLLM is not installed (pip install vllm, on a machine with CUDA); drop --use-vllm to sample "
            "with the training model's generate"
        )
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--use-vllm: vLLM samples on a CUDA GPU and this machine has none; drop --use-vllm")


def check(settings: Sections) -> None:
    check_rollout(settings, "grpo")
    o: GrpoOptions = settings.task_options
    if o.delta is not None and not o.delta > 1 + o.epsilon:
        raise ConfigError(f"--delta {o.delta}: must be above 1 + --epsilon ({1 + o.epsilon:g})")


def seq_length(settings: Sections) -> int:
    """A sequence is a prompt and its completion: --max-prompt-length (512 unset) + --max-completion-length."""
    return (settings.preference.max_prompt_length or 512) + settings.task_options.max_completion_length


def generation(settings: Sections) -> tuple[int, int]:
    """What a rank samples together (``--generation-batch-size``, at most its share of the global batch) and how
    long a sequence grows: the planner's key/value cache."""
    share = settings.batching.global_batch_size // max(settings.topology.dp, 1)
    rows = min(settings.task_options.generation_batch_size or share, share)
    return rows, seq_length(settings)


def online_rl_task(**own: Any) -> TaskSpec:
    """A ``TaskSpec`` with what every online-RL task declares alike (``grpo``, ``rloo``): its name, summary,
    trainer, options, check and demo are ``own``."""
    return TaskSpec(
        required=("--pretrained-model-name-or-path", "--data-path", "--reward-funcs"),
        defaults={"seq_length": seq_length},
        load_model_dir=True,
        auto_class="AutoModelForCausalLM",
        reference=online_reference,
        generation=generation,
        ignored=IGNORED,
        chunked_loss="tokens",
        # The training step's and the scoring's forwards split each sequence; the rollout samples it whole.
        context_parallel=True,
        **own,
    )


TASK = online_rl_task(
    name="grpo",
    summary="online RL of AutoModelForCausalLM on prompts with reward functions (GRPO, DAPO, Dr. GRPO, GSPO)",
    trainer="rapidlite.tasks.grpo:trainer_for",
    options=GrpoOptions,
    demo="rapidlite.tasks.grpo_demo:demo",
    check=check,
)
