"""What the HF rollout samples from, against distributions worked out here: softmax(logits / T) cut by top-k then
top-p as transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper`` (and vLLM) define them, greedy's argmax, the
``n`` samples of a prompt as independent draws, and the actor's log-probs and entropies of the sampled tokens
equal to those of the distribution each token was drawn from (an on-policy ratio of 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlhf_core.batch import Batch
from rlhf_core.data.dataset import left_pad
from rlhf_core.models import packed_attention
from rlhf_core.models.loading import load_actor, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams, hf, make_rollout_engine
from rlhf_core.workers.actor import response_log_prob


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) after top-k then top-p, as transformers defines them, in float64: top-k keeps every
    token at least as likely as the k-th (ties at the boundary all stay; k <= 0 is off); top-p drops, from the
    least likely up, each token whose mass together with all less likely ones is at most 1 - top_p, so the token
    that crosses top_p stays, and the most likely token always stays (min_tokens_to_keep = 1)."""
    scaled = logits.astype(np.float64) / temperature
    if top_k > 0:
        kth = np.sort(scaled)[::-1][min(top_k, len(scaled)) - 1]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    if top_p < 1.0:
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        ascending = np.argsort(probs, kind="stable")
        tail = np.cumsum(probs[ascending])  # the mass of each token and of all less likely ones
        drop = tail <= 1 - top_p
        drop[-1] = False
        scaled = scaled.copy()
        scaled[ascending[drop]] = -np.inf
    probs = np.exp(scaled - scaled.max())
    return probs / probs.sum()


#: eight logits with a three-way tie under the top token, then distinct values (none tied at a top-p boundary)
LOGITS = np.array([2.0, 1.0, 1.0, 1.0, 0.4, 0.0, -1.1, -3.0])
CASES = {
    "plain": (1.0, -1, 1.0),
    "hot": (1.7, -1, 1.0),
    "cold": (0.6, -1, 1.0),
    "top_k=0 is off": (0.9, 0, 1.0),
    "top_k past the vocabulary": (1.0, 50, 1.0),
    "top_k=2 keeps the tie": (0.8, 2, 1.0),  # the 2nd logit is tied with the 3rd and 4th: all stay
    "top_k=5": (1.2, 5, 1.0),
    "top_p crossing": (1.0, -1, 0.9),
    "top_p tiny keeps one": (1.0, -1, 1e-6),
    "top_p high": (1.3, -1, 0.95),
    "top_k then top_p": (0.8, 5, 0.92),
    "top_k then top_p to one": (1.0, 2, 0.4),
}


def test_the_reference_is_transformers_warpers():
    """The definition above is transformers' (HF generate's) top-k then top-p, on these logits."""
    for name, (temperature, top_k, top_p) in CASES.items():
        scores = torch.tensor(LOGITS, dtype=torch.float64)[None] / temperature
        if top_k > 0:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        np.testing.assert_allclose(scores.softmax(-1)[0].numpy(), reference_probs(LOGITS, temperature, top_k, top_p),
                                   rtol=1e-12, atol=0, err_msg=name)


def test_the_reference_cuts_where_the_definitions_say():
    """Hand-worked supports on :data:`LOGITS`, so that the reference itself is pinned."""
    def support(temperature, top_k, top_p):
        return np.flatnonzero(reference_probs(LOGITS, temperature, top_k, top_p)).tolist()

    assert support(0.8, 2, 1.0) == [0, 1, 2, 3]  # the tie at the k-th token stays whole
    assert support(1.0, -1, 1e-6) == [0]
    # softmax at T=1: .401, .148 (x3), .081, .054, .018, .003: the first five hold .925, the first four .844,
    # so top_p=0.9 is crossed by the fifth, which stays; the sixth's tail (.054 + .018 + .003 = .075) is <= 0.1
    assert support(1.0, -1, 0.9) == [0, 1, 2, 3, 4]
    # top-2 keeps the tie (4 tokens: .475, .175 x3 renormalised); top_p=0.4 is crossed by the first alone
    assert support(1.0, 2, 0.4) == [0]
    assert support(1.0, 0, 1.0) == list(range(8)) == support(1.0, -1, 1.0)


@pytest.mark.parametrize("name", list(CASES))
def test_the_sampler_draws_from_softmax_over_temperature_cut_by_top_k_then_top_p(name, monkeypatch):
    temperature, top_k, top_p = CASES[name]
    expected = reference_probs(LOGITS, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    draws = 20000
    logits = torch.tensor(LOGITS, dtype=torch.float32)[None].repeat(draws, 1)

    # the probabilities handed to the draw: the exact distribution, to float32 rounding
    handed = []
    draw = hf.draw_from
    monkeypatch.setattr(hf, "draw_from", lambda probs, generator: handed.append(probs) or draw(probs, generator))
    drawn = hf.sample_next_token(logits, params, torch.Generator().manual_seed(11))
    np.testing.assert_allclose(handed[0][0].double().numpy(), expected, rtol=1e-5, atol=1e-7, err_msg=name)
    assert torch.equal(handed[0], handed[0][:1].expand_as(handed[0]))
    tied = [1, 2, 3]  # each case keeps the tie whole or drops it whole, so that the distribution is defined
    assert len({bool(expected[i] > 0) for i in tied}) == 1, name

    # and the draws' frequencies: never a token the cut removed, the rest by a chi-square test (fixed seed)
    counts = np.bincount(drawn.numpy(), minlength=len(LOGITS))
    assert counts[expected == 0].sum() == 0, name
    kept = expected > 0
    if kept.sum() > 1:
        assert chisquare(counts[kept], draws * expected[kept]).pvalue > 1e-4, (name, counts, expected)


def test_a_tie_at_the_top_p_boundary_keeps_as_many_tokens_as_needed_and_those_transformers_keeps(monkeypatch):
    """Where equal logits straddle the top-p boundary, the kept set is still the smallest whose mass reaches top_p:
    as many of the tied tokens as it needs (hand-worked below), and the same ones as ``TopPLogitsWarper`` keeps (the
    higher ids)."""
    # softmax([2, 1, 1, 1, 0]) = e^2, e, e, e, 1 over 7.389 + 3 x 2.718 + 1 = 16.545: .4466, .1643 x3, .0604; top_p
    # 0.6 is crossed by the first of the tie (.6109): two tokens stay, renormalised to .4466 / .6109 and .1643 / .6109
    e = np.e
    total = e ** 2 + 3 * e + 1
    first, tied = e ** 2 / total, e / total
    cases = [([2.0, 1.0, 1.0, 1.0, 0.0], 0.6, [first / (first + tied), tied / (first + tied)]),
             ([1.0, 1.0, 1.0, 1.0], 0.5, [0.5, 0.5]),  # .25 + .25 reaches 0.5: two of the four
             ([1.0, 1.0, 1.0, 1.0], 0.51, [1 / 3] * 3),  # two reach only .5: three
             # 1, e, e, e^2 over 13.826: .5344 then .1966 (x2) crosses 0.6, so one of the tie stays
             ([0.0, 1.0, 1.0, 2.0], 0.6, [e / (e + 1), 1 / (e + 1)])]
    handed = []  # the probabilities each draw is handed
    draw = hf.draw_from
    monkeypatch.setattr(hf, "draw_from", lambda probs, generator: handed.append(probs[0].double()) or draw(
        probs, generator))
    for logits, top_p, kept in cases:
        scores = torch.tensor([logits])
        hf.sample_next_token(scores, SamplingParams(top_p=top_p), torch.Generator().manual_seed(0))
        ours = handed[-1][handed[-1] > 0].sort(descending=True).values
        theirs = TopPLogitsWarper(top_p)(None, scores.double()).softmax(-1)[0]
        assert torch.equal(handed[-1] > 0, theirs > 0), (logits, top_p)
        np.testing.assert_allclose(ours.numpy(), kept, rtol=1e-6, err_msg=str((logits, top_p)))


@pytest.mark.parametrize("top_p", [0.9, 0.95, 0.99, 0.999])
def test_top_p_over_a_large_vocabulary_keeps_the_set_worked_out_in_float64(top_p, monkeypatch):
    """Over Qwen2's 151,936 tokens, at T=1 with logits spread as N(0, 2^2): the tokens top-p keeps are those of the
    float64 reference, down to the least likely of them (each some 1e-6 of the mass: float32's rounding of a running
    sum near top_p, 6e-8 a step, must not drop them)."""
    logits = np.random.default_rng(7).normal(0.0, 2.0, 151936).astype(np.float32)
    expected = reference_probs(logits, 1.0, -1, top_p) > 0
    handed = []
    draw = hf.draw_from
    monkeypatch.setattr(hf, "draw_from", lambda probs, generator: handed.append(probs[0]) or draw(probs, generator))
    hf.sample_next_token(torch.from_numpy(logits)[None], SamplingParams(top_p=top_p), torch.Generator().manual_seed(0))
    kept = (handed[0] > 0).numpy()
    assert kept.sum() == expected.sum() and (kept == expected).all()


def test_a_top_p_below_float32s_resolution_still_keeps_the_likeliest_token():
    """Below about 6e-8, 1 - top_p rounds to 1.0 in float32, so every token's tail is at most it: the likeliest
    token stays all the same (transformers' min_tokens_to_keep=1), and with it alone kept the draw is the argmax."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    for top_p in (1e-9, 1e-12):
        drawn = hf.sample_next_token(logits, SamplingParams(top_p=top_p), torch.Generator().manual_seed(0))
        assert drawn.tolist() == [3, 0], top_p


def test_the_cut_distribution_is_followed_over_a_vocabulary_of_several_draw_blocks():
    """Over 1,000 tokens (the two-level draw's blocks, :data:`hf.CDF_BLOCK` each) with the kept tokens spread
    among them: top-k 40 then top-p 0.9 at T=0.8, the draws' frequencies against the reference's."""
    logits = np.random.default_rng(3).normal(0.0, 2.0, 1000)
    expected = reference_probs(logits, 0.8, 40, 0.9)
    kept = expected > 0
    assert 5 < kept.sum() < 40 and len(set(np.flatnonzero(kept) // hf.CDF_BLOCK)) > 1
    draws = 20000
    drawn = hf.sample_next_token(torch.tensor(logits, dtype=torch.float32)[None].repeat(draws, 1),
                                 SamplingParams(temperature=0.8, top_k=40, top_p=0.9), torch.Generator().manual_seed(5))
    counts = np.bincount(drawn.numpy(), minlength=len(logits))
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], draws * expected[kept]).pvalue > 1e-4


def test_greedy_takes_the_argmax_and_the_first_of_tied_maxima():
    """do_sample=false, or temperature 0, picks the largest logit; among equal maxima the lowest index, as
    torch.argmax (HF's greedy search, vLLM's greedy sampler) breaks ties."""
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0, 2.9],
                           [5.0, 5.0, 5.0, 5.0, 5.0],
                           [-2.0, -1.0, -3.0, -1.0, -1.5]])
    for params in (SamplingParams(do_sample=False), SamplingParams(temperature=0.0),
                   SamplingParams(do_sample=False, temperature=0.7, top_k=1, top_p=0.1)):
        assert hf.sample_next_token(logits, params, torch.Generator().manual_seed(0)).tolist() == [1, 0, 1]


# ---------------------------------------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_toy_model(tmp_path_factory.mktemp("sampling") / "model", n_layers=2, hidden_size=64, seed=5)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _eos_likely(model: torch.nn.Module, eos: int, boost: float) -> torch.nn.Module:
    """The model with its EOS row of the LM head moved towards the mean hidden direction, so that responses of a
    few tokens sometimes end (a random model gives EOS about one time in a vocabulary's size)."""
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[eos] += boost * model.model.norm.weight / model.model.norm.weight.norm()
    return model


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits after the token list ``ids``, from one plain forward of it alone (no padding, no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].double()


def test_the_n_samples_of_a_prompt_are_independent_draws_from_its_distribution(model_dir, tokenizer):
    """The first tokens of n=3000 samples of each prompt follow softmax(logits / T) of that prompt (the same
    sequence n times, or draws that share one uniform, would not), and the seed reproduces them."""
    model = load_actor(model_dir)
    prompts = [tokenizer("12+", add_special_tokens=False)["input_ids"],
               tokenizer("Tom has 5", add_special_tokens=False)["input_ids"]]
    batch = Batch(left_pad(prompts, tokenizer.pad_token_id), {"uid": [0, 1]})
    n, temperature = 3000, 0.6
    params = SamplingParams(n=n, max_new_tokens=1, temperature=temperature, top_k=20)
    out = make_rollout_engine("hf", model, tokenizer, seed=2).generate(batch, params)
    for index, ids in enumerate(prompts):
        expected = reference_probs(_last_logits(model, ids).numpy(), temperature, 20, 1.0)
        counts = np.bincount(out["responses"][index * n:(index + 1) * n, 0].numpy(), minlength=len(expected))
        assert counts[expected == 0].sum() == 0
        kept = expected > 0
        assert chisquare(counts[kept], n * expected[kept]).pvalue > 1e-4, index
    again = make_rollout_engine("hf", model, tokenizer, seed=2).generate(batch, params)
    assert torch.equal(again["responses"], out["responses"])


@pytest.mark.parametrize("fused_decode", [True, False])
@pytest.mark.parametrize("path", ["padded", "fused_head", "shared_prefix", "remove_padding"])
def test_the_actors_log_probs_are_those_the_rollout_sampled_from(model_dir, tokenizer, monkeypatch, path,
                                                                   fused_decode):
    """Left-padded prompts of different lengths, n=3 samples each, some ending at EOS and some at the length
    limit: for each response token, ``log_softmax(logits / T)`` of the logits the sampler was handed, the same
    of a plain forward over that row's tokens alone, and the actor's ``old_log_prob`` all agree (the on-policy
    ratio is 1), and the actor's entropy is that of softmax(logits / T). The response mask covers the EOS."""
    monkeypatch.setattr(hf, "FUSED_DECODE", fused_decode)
    eos = tokenizer.eos_token_id
    attention = packed_attention.NAME if path == "remove_padding" else None
    model = _eos_likely(load_actor(model_dir, attn_implementation=attention), eos, boost=7.0)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("7*8=", "Tom has 12 apples", "a")]
    temperature, max_new = 0.7, 6
    params = SamplingParams(n=3, max_new_tokens=max_new, temperature=temperature)

    seen = []  # the logits each step's draw saw, (rows, V) a step
    sample = hf.sample_next_token
    monkeypatch.setattr(hf, "sample_next_token",
                        lambda logits, p, g: seen.append(logits.double().clone()) or sample(logits, p, g))
    out = make_rollout_engine("hf", model, tokenizer, seed=0).generate(
        Batch(left_pad(prompts, tokenizer.pad_token_id), {"uid": [0, 1, 2]}), params)

    responses, mask = out["responses"], out["response_mask"]
    lengths = mask.sum(-1).tolist()
    ended = [row for row in range(len(lengths)) if eos in responses[row].tolist()]
    assert ended and any(length == max_new and row not in ended for row, length in enumerate(lengths))
    assert any(length < max_new for length in lengths)
    for row, length in enumerate(lengths):
        tokens = responses[row].tolist()
        if row in ended:  # the mask runs to the EOS, inclusive; padding after it
            assert tokens.index(eos) == length - 1
            assert tokens[length:] == [tokenizer.pad_token_id] * (len(tokens) - length)
        assert mask[row].tolist() == [1] * length + [0] * (len(tokens) - length)

    expected_lp = torch.zeros(mask.shape, dtype=torch.float64)
    sampled_lp = torch.zeros(mask.shape, dtype=torch.float64)
    expected_entropy = torch.zeros(mask.shape, dtype=torch.float64)
    for row, length in enumerate(lengths):
        ids = prompts[row // params.n] + responses[row, :length].tolist()
        with torch.no_grad():  # the row alone: no padding, no cache, position ids 0..L-1
            logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].double()
        log_p = torch.log_softmax(logits[-length:] / temperature, -1)  # (length, V): the positions that predict
        expected_lp[row, :length] = log_p.gather(-1, responses[row, :length, None]).squeeze(-1)
        expected_entropy[row, :length] = -(log_p.exp() * log_p).sum(-1)
        for step in range(length):
            drawn_from = torch.log_softmax(seen[step][row] / temperature, -1)
            sampled_lp[row, step] = drawn_from[responses[row, step]]
    torch.testing.assert_close(sampled_lp, expected_lp, atol=2e-5, rtol=0)

    batch = Batch({k: out[k] for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                       "position_ids")})
    with torch.no_grad():
        log_prob, entropy = response_log_prob(
            model, batch, temperature, with_entropy=True, remove_padding=path == "remove_padding",
            fused_head=path == "fused_head", shared_prefix=path == "shared_prefix")
    torch.testing.assert_close(log_prob.double(), expected_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), expected_entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(log_prob.double(), sampled_lp, atol=2e-5, rtol=0)  # ratio exp(0) = 1
