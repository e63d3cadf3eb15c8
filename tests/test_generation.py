"""Sampling completions with a key/value cache (rapidlite.generation.sampling): equal to Hugging Face's greedy
``generate`` where only one token survives the filters, and a completion depends on its prompt and key only."""

from __future__ import annotations

import pytest
import torch

from rapidlite.generation.sampling import SamplingSettings, completion_key, sample
from rapidlite.tasks.causal_lm_demo import write_demo_assets


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = write_demo_assets(tmp_path_factory.mktemp("gen"), seed=4, num_train=8, num_validation=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse: a b c", "reverse: d", "reverse: e f g h i j")]
    return model, tokenizer, prompts


def test_one_surviving_token_is_hugging_faces_greedy_generate(lm):
    """top_k=1 leaves the argmax only: batched, left-padded, cached sampling gives generate's greedy completions
    (up to and including EOS), so the cache, the padding and the positions are right."""
    model, tokenizer, prompts = lm
    settings = SamplingSettings(max_completion_length=12, top_k=1, batch_size=3)
    ours = sample(model, prompts, [1, 2, 3], settings, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for prompt, completion, cut in zip(prompts, ours.ids, ours.truncated, strict=True):
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=12, pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()  # fmt: skip
        end = out.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in out else len(out)
        assert completion == out[:end]
        assert cut == (tokenizer.eos_token_id not in completion)


def test_a_completion_depends_on_its_prompt_and_key_only(lm):
    """With every filter on, the same (prompt, key) pairs sampled in another order, in other batches and one at a
    time give the same completions; another key gives another completion."""
    model, tokenizer, prompts = lm
    settings = SamplingSettings(
        max_completion_length=10, temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, repetition_penalty=1.2,
        batch_size=4,
    )  # fmt: skip
    pairs = [(p, completion_key(7, 0, i)) for i, p in enumerate(prompts * 2)]
    args = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    together = sample(model, [p for p, _ in pairs], [k for _, k in pairs], settings, *args).ids
    reversed_pairs = pairs[::-1]
    apart = sample(
        model, [p for p, _ in reversed_pairs], [k for _, k in reversed_pairs], SamplingSettings(
            **{**settings.__dict__, "batch_size": 2}
        ), *args,
    ).ids[::-1]  # fmt: skip
    alone = [sample(model, [p], [k], settings, *args).ids[0] for p, k in pairs]
    assert together == apart == alone
    assert together[0] != together[3]  # the same prompt under two keys
    assert completion_key(7, 0, 0) != completion_key(7, 1, 0) != completion_key(8, 0, 0)


def test_a_prompt_runs_once_and_ended_rows_leave_the_batch(lm):
    """GRPO's batches: four completions of each of two prompts. The prompt pass runs the two distinct prompts;
    each step runs the rows still going (when a quarter of the batch has ended, those rows leave it). The
    completions are the ones each (prompt, key) gives alone. The untrained model never says EOS: two tokens it
    samples stand in for it, so that rows end at different steps."""
    model, tokenizer, prompts = lm
    settings = SamplingSettings(max_completion_length=12, batch_size=8)
    group = [prompts[0]] * 4 + [prompts[2]] * 4
    keys = [completion_key(3, 0, i) for i in range(8)]
    unended = sample(model, group, keys, settings, tokenizer.eos_token_id, tokenizer.pad_token_id).ids
    eos = [unended[0][2], unended[5][6]]
    rows = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        out = sample(model, group, keys, settings, eos, tokenizer.pad_token_id)
    finally:
        hook.remove()
    lengths = sorted(len(ids) for ids in out.ids)
    assert rows[0] == (2, len(prompts[2])) and all(shape[1] == 1 for shape in rows[1:])
    steps = [shape[0] for shape in rows[1:]]
    assert steps == sorted(steps, reverse=True) and steps[0] == 8 and len(rows) == lengths[-1]
    assert lengths[0] <= 3 and steps[-1] < 8  # rows ended early and left the batch
    alone = [
        sample(model, [p], [k], settings, eos, tokenizer.pad_token_id).ids[0] for p, k in zip(group, keys, strict=True)
    ]
    assert out.ids == alone and all(u[: len(o)] == o for u, o in zip(unended, out.ids, strict=True))


def test_keyed_draws_follow_the_softmax():
    """20,000 keys over 5 tokens (one filtered out): each token is drawn as often as softmax(scores) says (within
    1.5 points), never the filtered one; the same key and step draw the same token, another step draws anew."""
    from rapidlite.generation.sampling import draw, keyed_uniform

    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")]).expand(20000, 5)
    keys = torch.tensor([completion_key(3, 0, i) & ((1 << 63) - 1) for i in range(20000)])
    drawn = draw(scores, keys, step=5)
    frequencies = torch.bincount(drawn, minlength=5).double() / len(keys)
    torch.testing.assert_close(frequencies, torch.softmax(scores[0].double(), -1), atol=0.015, rtol=0)
    assert torch.equal(drawn, draw(scores, keys, step=5)) and not torch.equal(drawn, draw(scores, keys, step=6))
    assert torch.equal(draw(scores[:7], keys[:7], step=5), drawn[:7])  # a row's draw is its own, in any batch
    uniform = keyed_uniform(keys, 5)
    assert 0 < float(uniform.min()) and float(uniform.max()) < 1
