"""``--dry-run`` plans every model family of the model specs for every task it serves: each Hugging Face
``model_type`` the specs name, built from its config at a tiny size with its realistic parts (a pad token, tied
or untied embeddings, grouped key/value heads, shared experts, latent attention, sliding windows), its activations
counted by the meta-device profile (no "activations NOT counted" fallback). The plans' accuracy against measured
runs is ``tests/test_dry_run.py``'s and ``tests/test_dry_run_tasks.py``'s."""

import random

import pytest
from test_dry_run import plans
from test_dry_run_tasks import WORDS, _rows

from helpers import word_tokenizer, write_jsonl

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
DECODER = {**SIZES, "num_key_value_heads": 2, "max_position_embeddings": 512}
EXPERTS = {"num_experts_per_tok": 2}
# model_type -> its config's own fields at a tiny size (beside DECODER's, or SIZES' for an encoder)
DECODERS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 16}, "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16}, "phi3": {}, "olmo": {}, "olmo2": {},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
    "mixtral": {**EXPERTS, "num_local_experts": 4},
    "qwen2_moe": {**EXPERTS, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**EXPERTS, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16},
    "olmoe": {**EXPERTS, "num_experts": 4},
    "deepseek_v3": {
        **EXPERTS, "n_routed_experts": 4, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
    },
    "gpt_oss": {
        **EXPERTS, "num_local_experts": 4, "head_dim": 16, "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}  # fmt: skip
ENCODERS = {"bert": {}, "roberta": {"max_position_embeddings": 514}, "xlm-roberta": {"max_position_embeddings": 514}}
DECODER_TASKS = ("causal_lm", "sequence_classification", "dpo", "kto", "reward_model", "grpo", "rloo")
ENCODER_TASKS = (
    "sequence_classification",
    "token_classification",
    "question_answering",
    "multiple_choice",
    "masked_lm",
)
RUN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2"]
ONLINE_RL = ["--max-prompt-length", "32", "--max-completion-length", "32", "--num-generations", "2"]
REWARD = "def reward(prompts, completions, **kwargs):\n    return [len(c) % 7 for c in completions]\n"


def test_the_specs_families_are_all_here():
    """A family added to the model specs joins this test (its model types below); a vision-language family joins
    tests/test_vision_language.py's (text tasks do not plan it)."""
    from rapidlite.models.spec import _REGISTRY

    covered = set(DECODERS) | set(ENCODERS)
    named = {model_type for spec in _REGISTRY if spec.vision is None for model_type in spec.model_types}
    assert named <= covered, sorted(named - covered)


def _model_dir(root, model_type, index, tokenizers):
    """``model_type``'s config at a tiny size beside a word-level tokenizer; the embeddings tied for every other
    type. Only ``config.json``: the plan builds the model on the meta device."""
    from transformers import AutoConfig

    encoder = model_type in ENCODERS
    tok = tokenizers["bert" if encoder else "causal"]
    ids = {"pad_token_id": tok.pad_token_id, "tie_word_embeddings": index % 2 == 0}
    if not encoder:
        ids |= {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    own = ENCODERS[model_type] if encoder else DECODERS[model_type]
    sizes = {} if model_type == "gpt2" else (SIZES | {"max_position_embeddings": 512} if encoder else DECODER)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), **(sizes | own | ids))
    directory = root / model_type
    config.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    tokenizers = {
        style: word_tokenizer(root / f"tokenizer-{style}", WORDS, style == "bert", model_max_length=1024)
        for style in ("bert", "causal")
    }
    (root / "reward.py").write_text(REWARD)
    rng, data, argvs = random.Random(0), {}, {}
    for task in {*DECODER_TASKS, *ENCODER_TASKS}:
        data[task] = write_jsonl(root / "data" / task, "train", _rows(task, rng, 8))
        write_jsonl(root / "data" / task, "validation", _rows(task, rng, 2))
    types = [*DECODERS, *ENCODERS]
    for index, model_type in enumerate(types):
        model = _model_dir(root, model_type, index, tokenizers)
        for task in ENCODER_TASKS if model_type in ENCODERS else DECODER_TASKS:
            argv = ["--task", task, "--pretrained-model-name-or-path", model, "--data-path", str(data[task]), *RUN]
            if task in ("grpo", "rloo"):  # a sequence is its prompt and completion
                argv += [*ONLINE_RL, "--reward-funcs", f"{root / 'reward.py'}:reward"]
            else:
                argv += ["--seq-length", "64", *(["--doc-stride", "16"] if task == "question_answering" else [])]
            argvs[f"{model_type}/{task}"] = argv
    return plans(argvs)


def _has_class(model_type: str, task: str) -> bool:
    """Whether transformers builds the class ``task`` builds (its ``TaskSpec``) for a config of ``model_type``."""
    import transformers

    from rapidlite.config.tasks import get_task

    auto = getattr(transformers, get_task(task).model_class_name(model_type))
    return transformers.AutoConfig.for_model(model_type).__class__ in auto._model_mapping


def test_every_family_plans_every_task_it_serves(planned):
    """Planned with its activations counted, or, where transformers has no class of the task's kind for the
    model's type (OLMoE has no sequence classifier), refused in one line that says so (no traceback)."""
    assert len(planned) == len(DECODERS) * len(DECODER_TASKS) + len(ENCODERS) * len(ENCODER_TASKS)
    for case, result in planned.items():
        model_type, task = case.split("/")
        if not _has_class(model_type, task):
            assert isinstance(result, dict), (case, "planned, but transformers has no class for it?")
            assert "transformers has no AutoModel" in result["error"], (case, result)
            continue
        assert isinstance(result, list), (case, result)
        (rank,) = result
        assert rank["activation_bytes"] > 0 and rank["param_bytes"] > 0 and rank["peak_bytes"] > 0, (case, rank)
