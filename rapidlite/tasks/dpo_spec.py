"""``--task dpo``'s declaration and checks (torch-free; the trainer is ``dpo.py``), and the preference tasks'
reference-model rule, which ``kto`` shares. The prompt cut and the precomputed reference are the shared
``PreferenceConfig`` section; the loss and its coefficients, beta among them, are DPO's own (``DpoOptions``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapidlite.config.fields import flag
from rapidlite.config.tasks import TaskSpec
from rapidlite.errors import ConfigError
from rapidlite.tasks.causal_lm_spec import check_split_sequences

if TYPE_CHECKING:  # the settings list the tasks: a task's declaration only names them
    from rapidlite.config.settings import Sections

SEQ_LENGTH = 1024  # TRL's max_length for DPO, KTO and reward models
LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
# The --loss-type values with no reference model; their log-probabilities are length-averaged (SimPO, ORPO).
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


@dataclass(frozen=True)
class DpoOptions:
    """The pair loss and its coefficients (TRL's names and defaults)."""

    loss_type: str = flag(
        "sigmoid",
        "sigmoid (DPO), ipo, hinge, robust (cDPO with --label-smoothing), simpo (no reference, length-normalised) "
        "or orpo (no reference: the chosen sequence's NLL plus the odds-ratio term)",
        choices=LOSSES,
    )
    beta: float = flag(0.1, "the KL penalty's strength (IPO: its regularisation tau; SimPO: the reward scale)")
    label_smoothing: float = flag(0.0, "dpo: the assumed share of flipped preference labels (sigmoid, robust, simpo)")
    simpo_gamma: float = flag(0.5, "dpo --loss-type simpo: the target reward margin")
    orpo_alpha: float = flag(0.1, "dpo --loss-type orpo: the weight of the odds-ratio term (TRL's ORPO beta)")
    rpo_alpha: float | None = flag(
        None, "dpo: add this times the NLL of the chosen response (RPO); ORPO always has it, at weight 1"
    )

    @property
    def reference_free(self) -> bool:
        """SimPO and ORPO use no reference model."""
        return self.loss_type in REFERENCE_FREE_LOSSES


def preference_reference(settings: Sections) -> str:
    """The reference model of a preference task (``Sections``): "none" (SimPO and ORPO have none), "precomputed"
    (``--precompute-ref-logprobs``: scores made before training, nothing kept), "adapters" (with ``--lora-rank``:
    the policy with its adapters disabled) or "copy" (a frozen copy laid out as the policy). A run continuing a
    LoRA adapter directory also uses "adapters" (the trainer sees the directory)."""
    options = settings.task_options
    if isinstance(options, DpoOptions) and options.reference_free:
        return "none"
    if settings.preference.precompute_ref_logprobs:
        return "precomputed"
    return "adapters" if settings.lora.lora_rank else "copy"


def check(settings: Sections) -> None:
    pref: DpoOptions = settings.task_options
    if pref.beta <= 0:
        raise ConfigError(f"--beta {pref.beta}: must be positive")
    if not 0 <= pref.label_smoothing < 0.5:
        raise ConfigError(
            f"--label-smoothing {pref.label_smoothing:g}: must be in [0, 0.5) (the share of flipped labels)"
        )
    if settings.preference.precompute_ref_logprobs and pref.reference_free:
        raise ConfigError(
            f"--precompute-ref-logprobs: --loss-type {pref.loss_type} uses no reference model; drop the flag"
        )
    if pref.rpo_alpha is not None and pref.loss_type == "orpo":
        raise ConfigError("--rpo-alpha: ORPO's loss has its NLL term already (at weight 1); drop --rpo-alpha")
    if pref.label_smoothing and pref.loss_type not in ("sigmoid", "robust", "simpo"):
        raise ConfigError(
            f"--label-smoothing: --loss-type {pref.loss_type} does not use it; use sigmoid, robust or simpo"
        )
    check_split_sequences(settings)


TASK = TaskSpec(
    name="dpo",
    summary="preference-train AutoModelForCausalLM on chosen/rejected pairs (DPO, IPO, SimPO, ORPO, ...)",
    trainer="rapidlite.tasks.dpo:trainer_for",
    required=("--pretrained-model-name-or-path", "--data-path"),
    options=DpoOptions,
    demo="rapidlite.tasks.dpo_demo:demo",
    defaults={"seq_length": SEQ_LENGTH},
    load_model_dir=True,
    check=check,
    context_parallel=True,
    eval_only=True,
    auto_class="AutoModelForCausalLM",
    inputs_per_sample=2,  # the chosen and the rejected sequence of a pair
    reference=preference_reference,
    chunked_loss="tokens",
    eval_harness=True,
    images=True,
)
