"""The online-RL losses (rapidlite.tasks.rl_losses) against TRL 1.16's GRPOTrainer and RLOOTrainer, on the same
log-probabilities, rewards and masks: losses, gradients, advantages and every metric."""

from __future__ import annotations

import itertools

import pytest
import torch

from rapidlite.tasks.causal_lm_demo import write_demo_assets
from rapidlite.tasks.rl_losses import (
    LOSS_TYPES,
    ClipSettings,
    group_advantages,
    loss_denominator,
    loss_numerator,
    masked_sums,
    policy_terms,
    rloo_advantages,
    rloo_terms,
)

trl = pytest.importorskip("trl")
B, T, G = 6, 5, 3  # completions, completion length, completions per prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model_dir, _ = write_demo_assets(tmp_path_factory.mktemp("rl"), seed=3, num_train=8, num_validation=2)
    return model_dir


def _length_reward(completions, **_):
    """Whole-number rewards from the completion's length (ties within groups happen), none for some."""
    return [None if len(c) % 7 == 0 else float(len(c) % 3) for c in completions]


def _first_letter_reward(completions, **_):
    return [float(c[:1] in "aeiou") for c in completions]


def _trainer(model_dir, kind: str, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    common = dict(
        output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=B,
        num_generations=G, max_completion_length=T, **config,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": "reverse: a b c"}, {"prompt": "reverse: d e"}])
    if kind == "grpo":
        args, cls = trl.GRPOConfig(**common), trl.GRPOTrainer
    else:
        args, cls = trl.RLOOConfig(**common), trl.RLOOTrainer
    trainer = cls(
        model=model, reward_funcs=[_length_reward, _first_letter_reward], args=args, train_dataset=data,
        processing_class=tok,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these calls skip
    return trainer


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logps = -2 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 1, 5, 4, 2])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64)
    return logps, old, ref, mask, advantages, entropies


def _trl_loss(trainer, logps, inputs, entropies):
    """TRL's _compute_loss with its model's log-probabilities replaced by ``logps``: (loss, d loss / d logps,
    the metrics it logged)."""
    leaf = logps.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, entropies, None)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss), leaf.grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


CLIPS = [dict(beta=0.0), dict(beta=0.04, epsilon_high=0.28, delta=1.5), dict(beta=0.04, bias_correction_kl=False)]


@pytest.fixture(scope="module")
def grpo_trainer(model_dir):
    return _trainer(model_dir, "grpo")


@pytest.mark.parametrize(
    "loss_type,level,clip", list(itertools.product(LOSS_TYPES, ("token", "sequence"), range(len(CLIPS))))
)
def test_grpo_loss_gradients_and_metrics_equal_trls(grpo_trainer, loss_type, level, clip):
    """Every loss type at both importance-sampling levels, with and without the KL term, clip-higher and the two-sided
    clip, the KL with and without its bias correction: the loss, its gradient and the metrics equal
    GRPOTrainer._compute_loss's (one micro-batch on one process, where TRL's normalisers and the global batch's
    agree)."""
    settings = ClipSettings(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, **CLIPS[clip])
    trainer = grpo_trainer  # one trainer, its loss settings set as its __init__ sets them from the config
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, settings.beta
    trainer.epsilon_low, trainer.epsilon_high = settings.epsilon, settings.high
    object.__setattr__(trainer.args, "delta", settings.delta)
    object.__setattr__(trainer.args, "use_bias_correction_kl", settings.bias_correction_kl)
    logps, old, ref, mask, advantages, entropies = _batch(seed=clip)
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": advantages,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    expected, expected_grad, trl_metrics = _trl_loss(trainer, logps, inputs, entropies)

    leaf = logps.clone().requires_grad_()
    terms = policy_terms(leaf, old, ref, advantages, mask, settings)
    loss = loss_numerator(terms.per_token_loss, mask, loss_type) / loss_denominator(
        loss_type, completions=B, tokens=int(mask.sum()), micro_batches=1, max_completion_length=T
    )
    loss.backward()
    assert float(loss) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-6, atol=1e-9)

    def mean(values):
        total, count = masked_sums(values, mask)
        return float(total / count.clamp(min=1))

    ours = {
        "entropy": mean(entropies),
        "clip_ratio/low_mean": mean(terms.low_clipped.double()),
        "clip_ratio/high_mean": mean(terms.high_clipped.double()),
        "clip_ratio/region_mean": mean(terms.region_clipped.double()),
    }
    if settings.beta:
        ours["kl"] = mean(terms.per_token_kl)
    assert set(ours) <= set(trl_metrics)
    for name, value in ours.items():
        assert value == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-9), name


def _trl_scored(trainer):
    """A rollout of TRL's own: two prompts, G completions each, scored by both reward functions. Returns what it
    computed (advantages, metrics) and the rewards per function it computed them from."""
    prompts = [{"prompt": "reverse: a b c"}] * G + [{"prompt": "reverse: d e"}] * G
    torch.manual_seed(1)
    trainer._metrics["train"].clear()
    for value in trainer._logs["rewards"].values():
        value.clear()
    out = trainer._generate_and_score_completions(prompts)
    rewards = torch.tensor(
        [list(trainer._logs["rewards"][name])[-B:] for name in trainer.reward_func_names], dtype=torch.float32
    ).T
    return out, rewards, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_and_reward_metrics_equal_trls(model_dir, scale_rewards):
    """GRPO's advantages and reward metrics for each --scale-rewards equal those GRPOTrainer computes on its own
    rollout (rewards with ties, a group whose spread is zero, completions some function did not score)."""
    trainer = _trainer(model_dir, "grpo", scale_rewards=scale_rewards, reward_weights=[1.0, 0.5])
    out, rewards, trl_metrics = _trl_scored(trainer)
    ours = group_advantages(rewards, torch.tensor([1.0, 0.5]), G, scale_rewards)
    torch.testing.assert_close(ours.advantages, out["advantages"].float(), rtol=1e-5, atol=1e-6)
    metrics = ours.metrics(trainer.reward_func_names)
    for name, value in metrics.items():
        assert value == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6, nan_ok=True), name


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_loss_and_gradients_equal_trls(model_dir, normalize):
    """RLOO's leave-one-out advantages (and reward metrics) on RLOOTrainer's own rollout, then its clipped
    sequence-level loss and gradient on fixed log-probabilities, equal RLOOTrainer's."""
    trainer = _trainer(model_dir, "rloo", normalize_advantages=normalize, reward_weights=[1.0, 0.5])
    out, rewards, trl_metrics = _trl_scored(trainer)
    ours = rloo_advantages(rewards, torch.tensor([1.0, 0.5]), G, normalize)
    torch.testing.assert_close(ours.advantages, out["advantages"].float(), rtol=1e-5, atol=1e-6)
    for name, value in ours.metrics(trainer.reward_func_names).items():
        assert value == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6, nan_ok=True), name

    logps, old, _, mask, advantages, entropies = _batch(seed=7)
    old_sums = (old * mask).sum(1)
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": advantages,
        "old_logps": old_sums,
    }  # fmt: skip
    expected, expected_grad, trl_metrics = _trl_loss(trainer, logps, inputs, entropies)
    leaf = logps.clone().requires_grad_()
    terms = rloo_terms(leaf, old_sums, advantages, mask, trainer.epsilon_low, trainer.epsilon_high)
    loss = terms.per_token_loss.sum() / loss_denominator("grpo", B, int(mask.sum()), 1, T)
    loss.backward()
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-6, atol=1e-9)
    for name, flags in (("low", terms.low_clipped), ("high", terms.high_clipped), ("region", terms.region_clipped)):
        assert float(flags.double().mean()) == pytest.approx(trl_metrics[f"clip_ratio/{name}_mean"], rel=1e-6)


def test_nothing_scored_gets_no_advantage_and_a_lone_group_member_none():
    """A completion no function scored is out of its group's mean and gets 0; under RLOO so does the only scored
    member of a group (no other to compare with)."""
    nan = float("nan")
    rewards = torch.tensor([[1.0], [nan], [3.0], [2.0], [nan], [nan]])
    grpo = group_advantages(rewards, torch.ones(1), 3, "none")
    assert grpo.advantages.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    rloo = rloo_advantages(rewards, torch.ones(1), 3, normalize=False)
    assert rloo.advantages.tolist() == [-2.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    assert grpo.metrics(["f"])["rewards/f/mean"] == pytest.approx(2.0)


def test_prompts_are_tokenized_as_trl_tokenizes_them(model_dir, grpo_trainer):
    """Text prompts and conversations (the chat template's generation prompt) give GRPOTrainer._tokenize_prompts'
    ids; --max-prompt-length keeps a prompt's end; a row without a prompt is one line."""
    from transformers import AutoTokenizer

    from rapidlite.data.instruction import set_chat_template
    from rapidlite.data.prompts import check_layout, read_prompts
    from rapidlite.errors import DataError

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    set_chat_template(tokenizer, "chatml")
    grpo_trainer.processing_class = tokenizer
    texts = ["reverse: a b c", "reverse: d e f g"]
    chats = [[{"role": "user", "content": t}] for t in texts]
    for prompts in (texts, chats):
        ours, counts = read_prompts([{"prompt": p, "answer": "x"} for p in prompts], tokenizer, None)
        expected, _, _ = grpo_trainer._tokenize_prompts(prompts)
        assert [p.ids for p in ours] == [list(ids) for ids in expected]
        assert ours[0].columns == {"answer": "x"} and ours[0].prompt == prompts[0]
    assert counts.conversations == 2
    cut, counts = read_prompts([{"prompt": texts[1]}], tokenizer, 3)
    assert cut[0].ids == list(grpo_trainer._tokenize_prompts(texts[1:])[0][0][-3:]) and counts.cut == 1
    with pytest.raises(DataError, match="row 1 has an empty prompt"):
        read_prompts([{"prompt": "a"}, {"prompt": " "}], tokenizer, None)
    with pytest.raises(DataError, match="the data has question, answer: rename the prompt column"):
        check_layout(["question", "answer"])


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_rollout_tensors_and_completion_metrics_equal_trls(model_dir, mask_truncated):
    """On GRPOTrainer's own rollout (completions of at most 5 tokens: some cut at the limit): the padded prompts and
    completions, their masks (a cut completion masked whole with --mask-truncated-completions) and the
    completions/* metrics equal TRL's."""
    from transformers import AutoTokenizer

    from rapidlite.generation.rollout import completion_metrics, rollout_batch

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    # An EOS logit raised by 2.5 (the untrained model rarely ends 5 tokens in): some end, some are cut.
    bias = {"sequence_bias": [[[eos], 2.5]]}
    trainer = _trainer(model_dir, "grpo", mask_truncated_completions=mask_truncated, generation_kwargs=bias)
    out, _, trl_metrics = _trl_scored(trainer)
    prompts = [ids[m.bool()].tolist() for ids, m in zip(out["prompt_ids"], out["prompt_mask"], strict=True)]
    # The completions as generated: a masked one (cut at the limit, masked whole) has the limit's length.
    pad = trainer.processing_class.pad_token_id
    completions = [
        ids[: int(m.sum()) or T].tolist() for ids, m in zip(out["completion_ids"], out["completion_mask"], strict=True)
    ]
    ours = rollout_batch(prompts, completions, trainer.eos_token_ids, pad, mask_truncated)
    torch.testing.assert_close(ours.prompt_ids, out["prompt_ids"])
    torch.testing.assert_close(ours.prompt_mask, out["prompt_mask"].long())
    torch.testing.assert_close(ours.completion_ids, out["completion_ids"])
    torch.testing.assert_close(ours.completion_mask, out["completion_mask"].long())
    assert ours.truncated.any() and not ours.truncated.all()  # both kinds in this rollout
    for name, value in completion_metrics(ours.lengths, ours.truncated).items():
        assert value == pytest.approx(trl_metrics[name]), name


@pytest.mark.parametrize("chunked", [True, False])
def test_completion_logps_at_the_sampling_temperature_equal_trls(model_dir, tmp_path, chunked):
    """The completion tokens' log-probabilities and entropies at temperature 0.7, through the chunked output layer
    (8192 rows: the whole logits never made) or the whole logits, equal GRPOTrainer's (its own fused head)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rapidlite.models.head import output_logps

    config = LlamaConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "big")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "big")
    trainer = _trainer(tmp_path / "big", "grpo", temperature=0.7)
    g = torch.Generator().manual_seed(0)
    prompt, completion = torch.randint(3, 300, (4, 3), generator=g), torch.randint(3, 300, (4, 4), generator=g)
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[1, 5:], mask[3, 6:] = 0, 0  # completions of 2 and 3 tokens
    ids = torch.cat([prompt, completion], dim=1)
    with torch.no_grad():
        expected, expected_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, 4, compute_entropy=True
        )
    model = LlamaForCausalLM.from_pretrained(tmp_path / "big")
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    with torch.no_grad():
        logps, (entropy, _) = output_logps(
            model, {"input_ids": ids, "attention_mask": mask}, labels, shift=True, chunked=chunked, stats=True,
            temperature=0.7,
        )  # fmt: skip
    keep = mask[:, 3:].bool()
    torch.testing.assert_close(logps[:, 2:6][keep], expected[keep].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[:, 2:6][keep], expected_entropy[keep].float(), rtol=1e-5, atol=1e-5)
