"""The HF rollout engine: EOS handling, groups of samples, greedy equals transformers' generate."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.batch import Batch
from rlhf_core.data.dataset import left_pad
from rlhf_core.models.loading import load_actor, load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams, make_rollout_engine
from rlhf_core.rollout.cache import PreallocatedCache
from rlhf_core.rollout.hf import draw_from, sample_next_token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_toy_model(tmp_path_factory.mktemp("rollout") / "model", n_layers=1, hidden_size=32, seed=3)


@pytest.fixture(scope="module")
def actor(model_dir):
    return load_actor(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _prompts(tokenizer, texts):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return Batch(left_pad(ids, tokenizer.pad_token_id), {"uid": list(range(len(texts)))})


def test_greedy_matches_transformers_generate(actor, tokenizer):
    prompts = _prompts(tokenizer, ["What is 3+4?", "Hi", "Tom has 12 apples and"])
    engine = make_rollout_engine("hf", actor, tokenizer, seed=0)
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=12, do_sample=False))
    reference = actor.generate(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                               max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = reference[:, prompts["input_ids"].shape[1]:].tolist()
    for row in range(3):
        # the response runs to transformers' first EOS (kept) or to the 12 tokens asked for
        tokens = expected[row]
        eos = [i for i, t in enumerate(tokens) if t == tokenizer.eos_token_id]
        length = eos[0] + 1 if eos else 12
        assert int(out["response_mask"][row].sum()) == length
        assert out["responses"][row, :length].tolist() == tokens[:length]


class _EosAfter(torch.nn.Module):
    """A fake causal LM that emits token 7 until step k_row, then EOS, per row."""

    def __init__(self, stop_at, eos_id, vocab=16):
        super().__init__()
        self.stop_at, self.eos_id, self.vocab = stop_at, eos_id, vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids, use_cache=True, **kwargs):
        step = self.calls
        self.calls += 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e4)
        for row in range(input_ids.shape[0]):
            token = self.eos_id if step >= self.stop_at[row % len(self.stop_at)] else 7
            logits[row, -1, token] = 0.0
        return type("Out", (), {"logits": logits})()


def test_eos_is_kept_in_the_mask_and_everything_after_is_masked(tokenizer):
    eos = tokenizer.eos_token_id
    fake = _EosAfter(stop_at=[0, 2, 9], eos_id=eos)
    fake.generation_config = None
    engine = make_rollout_engine("hf", fake, tokenizer)
    prompts = Batch(left_pad([[5, 6], [5], [6, 6, 6]], tokenizer.pad_token_id), {"uid": [0, 1, 2]})
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=5, do_sample=False))
    assert out["responses"].shape == (3, 5)
    assert out["responses"][0].tolist()[:1] == [eos]
    assert out["response_mask"].tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out["responses"][1].tolist() == [7, 7, eos, tokenizer.pad_token_id, tokenizer.pad_token_id]
    # the full sequence carries the prompt then the response, masks aligned
    assert out["attention_mask"][1].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert out["position_ids"][1, 2:6].tolist() == [0, 1, 2, 3]


def test_the_tokenizers_eos_ends_a_response_beside_the_generation_configs_own(tokenizer):
    """A response ends at the tokenizer's EOS and at each id of the model's generation_config.eos_token_id, as
    transformers' generate stops: a model whose config lists only 5 still stops at the tokenizer's EOS."""
    from types import SimpleNamespace

    from rlhf_core.rollout.base import stop_tokens

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert (eos, pad) == (2, 0)  # (the toy tokenizer's </s> and <pad>)
    fake = _EosAfter(stop_at=[0], eos_id=eos)  # the tokenizer's EOS first
    fake.generation_config = SimpleNamespace(eos_token_id=[5])
    assert stop_tokens(fake, tokenizer) == ([2, 5], 0)
    engine = make_rollout_engine("hf", fake, tokenizer)
    out = engine.generate(Batch(left_pad([[3, 4]], pad), {"uid": [0]}), SamplingParams(max_new_tokens=4,
                                                                                       do_sample=False))
    assert out["responses"].tolist() == [[2]] and out["response_mask"].tolist() == [[1]]


def test_ignore_eos_samples_every_response_to_the_full_length(tokenizer):
    eos = tokenizer.eos_token_id
    fake = _EosAfter(stop_at=[0, 2], eos_id=eos)
    fake.generation_config = None
    engine = make_rollout_engine("hf", fake, tokenizer)
    prompts = Batch(left_pad([[5, 6], [5]], tokenizer.pad_token_id), {"uid": [0, 1]})
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, do_sample=False, ignore_eos=True))
    # the fake model keeps asking for EOS once it has started: the tokens after it are sampled, not padding
    assert out["responses"].tolist() == [[eos, eos, eos, eos], [7, 7, eos, eos]]
    assert out["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert fake.calls == 4  # one prompt forward and three decode steps
    assert out["attention_mask"][1].tolist() == [0, 1, 1, 1, 1, 1]


def test_the_engine_times_its_prefill_and_its_decode_loop_apart(tokenizer, monkeypatch):
    """On a clock that only the fake model moves (0.3 s for the prompts' pass, 0.05 s a decode step): the split
    that bench/roofline.py reads."""
    from types import SimpleNamespace

    from rlhf_core.rollout import hf

    clock = [100.0]
    monkeypatch.setattr(hf, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Timed(_EosAfter):
        def forward(self, input_ids, *args, **kwargs):
            clock[0] += 0.3 if self.calls == 0 else 0.05
            return super().forward(input_ids, *args, **kwargs)

    fake = Timed(stop_at=[9, 9], eos_id=tokenizer.eos_token_id)
    fake.generation_config = None
    engine = make_rollout_engine("hf", fake, tokenizer)
    prompts = Batch(left_pad([[5, 6], [5]], tokenizer.pad_token_id), {"uid": [0, 1]})
    engine.generate(prompts, SamplingParams(max_new_tokens=5, do_sample=False))
    # five tokens: the prompts' pass gives the first, four decode steps the rest
    assert engine.last_timing == {"prefill_s": pytest.approx(0.3), "decode_s": pytest.approx(4 * 0.05),
                                  "decode_forwards": 4}


def test_generation_stops_once_every_row_has_ended(tokenizer):
    fake = _EosAfter(stop_at=[1, 1], eos_id=tokenizer.eos_token_id)
    fake.generation_config = None
    engine = make_rollout_engine("hf", fake, tokenizer)
    prompts = Batch(left_pad([[5], [6]], tokenizer.pad_token_id), {"uid": [0, 1]})
    out = engine.generate(prompts, SamplingParams(max_new_tokens=50, do_sample=False))
    assert out["responses"].shape[1] == 2
    assert fake.calls == 2  # one prompt forward, one decode step; no wasted passes


def test_n_samples_are_adjacent_and_share_their_prompt(actor, tokenizer):
    prompts = _prompts(tokenizer, ["ab", "cde"])
    engine = make_rollout_engine("hf", actor, tokenizer, seed=1)
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6, temperature=1.0))
    assert len(out) == 6
    assert out.meta["uid"] == [0, 0, 0, 1, 1, 1]
    assert torch.equal(out["prompts"][0], out["prompts"][2])
    assert torch.equal(out["prompts"][3], prompts["input_ids"][1])


def test_sampling_is_reproducible_by_seed(actor, tokenizer):
    prompts = _prompts(tokenizer, ["ab", "cde"])
    params = SamplingParams(n=2, max_new_tokens=8)
    first = make_rollout_engine("hf", actor, tokenizer, seed=4).generate(prompts, params)
    second = make_rollout_engine("hf", actor, tokenizer, seed=4).generate(prompts, params)
    third = make_rollout_engine("hf", actor, tokenizer, seed=5).generate(prompts, params)
    assert torch.equal(first["responses"], second["responses"])
    assert not torch.equal(first["responses"], third["responses"])


def test_a_seeded_call_draws_a_stream_of_its_own_and_leaves_the_engines_generator_alone(actor, tokenizer):
    prompts = _prompts(tokenizer, ["ab", "cde"])
    engine = make_rollout_engine("hf", actor, tokenizer, seed=4)
    before = engine.generator.get_state()
    seeded = SamplingParams(n=2, max_new_tokens=8, seed=7)
    first = engine.generate(prompts, seeded)
    assert torch.equal(engine.generator.get_state(), before)  # the running stream has not moved
    assert torch.equal(engine.generate(prompts, seeded)["responses"], first["responses"])  # the same draws again
    # the running stream gives what a fresh engine of the same seed gives, as if the seeded calls had not happened
    running = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8))
    fresh = make_rollout_engine("hf", actor, tokenizer, seed=4).generate(prompts, SamplingParams(n=2, max_new_tokens=8))
    assert torch.equal(running["responses"], fresh["responses"])
    # another call seed, or another engine (another rank) with the same call seed, draws otherwise
    other_call = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=8))
    other_rank = make_rollout_engine("hf", actor, tokenizer, seed=5).generate(prompts, seeded)
    assert not torch.equal(other_call["responses"], first["responses"])
    assert not torch.equal(other_rank["responses"], first["responses"])
    assert not torch.equal(running["responses"], first["responses"])


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top1 = sample_next_token(logits, SamplingParams(top_k=1), gen)
    assert set(top1.tolist()) == {3}
    top2 = sample_next_token(logits, SamplingParams(top_k=2), gen)
    assert set(top2.tolist()) == {2, 3}
    # softmax([0,1,2,3]) = [.032, .087, .237, .644]: top_p=0.7 keeps {3, 2} (0.644 < 0.7 <= 0.881)
    nucleus = sample_next_token(logits, SamplingParams(top_p=0.7), gen)
    assert set(nucleus.tolist()) == {2, 3}
    share = (nucleus == 3).float().mean().item()
    assert abs(share - 0.644 / 0.881) < 0.04


@pytest.mark.parametrize(("temperature", "expected"), [
    # logits ln(1, 2, 4): at T=0.5 they double, softmax ~ (1, 4, 16) / 21 = .0476, .1905, .7619
    (0.5, [1 / 21, 4 / 21, 16 / 21]),
    # at T=2 they halve, softmax ~ (1, sqrt 2, 2) / (3 + sqrt 2) = .2265, .3204, .4531
    (2.0, [1 / (3 + 2 ** 0.5), 2 ** 0.5 / (3 + 2 ** 0.5), 2 / (3 + 2 ** 0.5)]),
])
def test_sampling_follows_softmax_of_logits_over_temperature(temperature, expected):
    # without the temperature it would be softmax(ln(1, 2, 4)) = (1, 2, 4) / 7 = .143, .286, .571: at least .19
    # from either expectation on the last token (and logits x T instead of / T swaps the two expectations)
    logits = torch.log(torch.tensor([[1.0, 2.0, 4.0]])).repeat(20000, 1)
    drawn = sample_next_token(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=3).double() / len(drawn)
    # binomial standard error at n=20000 is at most 0.0036 (p=0.5): 0.015 is more than four of them
    torch.testing.assert_close(counts, torch.tensor(expected, dtype=torch.float64), atol=0.015, rtol=0)


def test_draw_from_follows_the_probabilities_and_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    drawn = draw_from(probs, gen)
    counts = torch.bincount(drawn, minlength=6).double() / len(drawn)
    assert counts[[0, 2, 5]].sum() == 0
    # binomial standard error at p=0.6, n=20000 is 0.0035: 0.015 is more than four of them
    assert torch.allclose(counts, probs[0].double(), atol=0.015)
    # rows are drawn independently, each with its own distribution (one-hot rows are certain)
    eye = torch.eye(5)
    assert draw_from(eye, gen).tolist() == [0, 1, 2, 3, 4]


def test_the_two_level_draw_picks_what_one_float64_cdf_picks_for_the_same_uniform():
    gen = torch.Generator().manual_seed(1)
    probs = (torch.randn(3000, 1000, generator=gen) * 3).softmax(-1)  # 1000 = 3 blocks and a part one
    probs[:, 256:512] = 0  # a block with no mass
    probs[:, 3] = 1e-9  # a rare token beside likely ones
    drawn = draw_from(probs, torch.Generator().manual_seed(7))
    u = torch.rand(3000, 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)  # the same uniforms
    cdf = probs.double().cumsum(-1)
    assert torch.equal(drawn, torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1))
    assert not ((drawn >= 256) & (drawn < 512)).any()


def test_the_two_level_draw_follows_rare_and_scattered_mass():
    probs = torch.zeros(40000, 600)  # blocks 0-255, 256-511 and 512-599 (padded)
    probs[:, 3], probs[:, 4], probs[:, 300], probs[:, 599] = 0.5, 0.002, 0.25, 0.248
    drawn = draw_from(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=600).double() / len(drawn)
    assert drawn.shape == (40000,) and set(drawn.unique().tolist()) <= {3, 4, 300, 599}  # one draw a row, with mass
    # binomial standard errors at n=40000: 0.0025 at p=0.5, 0.00022 at p=0.002; the tolerances are 4 of them
    assert abs(counts[4] - 0.002) < 0.0009
    torch.testing.assert_close(counts[[3, 300, 599]], torch.tensor([0.5, 0.25, 0.248], dtype=torch.float64),
                               atol=0.01, rtol=0)


def test_a_row_of_nan_probabilities_is_drawn_past_the_vocabulary_not_out_of_range():
    for vocab in (6, 1000):  # one block, and 3 blocks and a part one
        probs = torch.full((3, vocab), 1.0 / vocab)
        probs[1] = float("nan")
        drawn = draw_from(probs, torch.Generator().manual_seed(0))
        assert drawn[1] == vocab and (drawn[[0, 2]] < vocab).all(), vocab


class _NanAt(_EosAfter):
    """The fake LM whose logits turn NaN for one row from one step on (weights that diverged)."""

    def __init__(self, row, step, eos_id):
        super().__init__(stop_at=[99], eos_id=eos_id)
        self.row, self.step = row, step

    def forward(self, input_ids, *args, **kwargs):
        out = super().forward(input_ids, *args, **kwargs)
        if self.calls - 1 >= self.step:
            out.logits[self.row] = float("nan")
        return out


def test_nan_logits_stop_sampling_with_what_usually_causes_them(tokenizer):
    from rlhf_core.rollout.hf import NonFiniteLogits

    fake = _NanAt(row=1, step=2, eos_id=tokenizer.eos_token_id)
    fake.generation_config = None
    fake.train()
    engine = make_rollout_engine("hf", fake, tokenizer)
    prompts = Batch(left_pad([[5, 6], [5], [6]], tokenizer.pad_token_id), {"uid": [0, 1, 2]})
    with pytest.raises(NonFiniteLogits, match=r"logits held NaN .* response token 2 of rows 1, .*learning rate"
                                              r".*bad checkpoint"):
        engine.generate(prompts, SamplingParams(max_new_tokens=6, do_sample=True, top_p=0.9, top_k=5))
    assert fake.calls == 3  # the prompts' pass and two decode steps: the NaN row's draw reaches no forward
    assert fake.training  # put back as generate found it


def test_a_model_with_nan_weights_fails_sampling_by_name_not_with_an_index_error(model_dir, tokenizer):
    from rlhf_core.rollout.hf import NonFiniteLogits

    broken = load_actor(model_dir)  # a checkpoint whose weights diverged
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    engine = make_rollout_engine("hf", broken, tokenizer, seed=0)
    with pytest.raises(NonFiniteLogits, match="response token 0 of rows 0, 1, 2, 3, so"):
        engine.generate(_prompts(tokenizer, ["Hi", "What is 3+4?"]), SamplingParams(n=2, max_new_tokens=4))


def test_greedy_decoding_of_nan_logits_fails_by_name_too(model_dir, tokenizer):
    """Greedy (validation's default) has no probabilities to invert, but argmax of a NaN row is an index in range:
    it must stop with the same error as sampling, not decode the NaN rows into tokens."""
    from rlhf_core.rollout.hf import NonFiniteLogits

    broken = load_actor(model_dir)
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    engine = make_rollout_engine("hf", broken, tokenizer, seed=0)
    for params in (SamplingParams(max_new_tokens=4, do_sample=False), SamplingParams(max_new_tokens=4, temperature=0)):
        with pytest.raises(NonFiniteLogits, match="response token 0 of rows 0, 1, so"):
            engine.generate(_prompts(tokenizer, ["Hi", "What is 3+4?"]), params)
    # one row's logits turn NaN at a later step: that row is named, at that step
    fake = _NanAt(row=1, step=2, eos_id=tokenizer.eos_token_id)
    fake.generation_config = None
    prompts = Batch(left_pad([[5, 6], [5], [6]], tokenizer.pad_token_id), {"uid": [0, 1, 2]})
    with pytest.raises(NonFiniteLogits, match="response token 2 of rows 1, so"):
        make_rollout_engine("hf", fake, tokenizer).generate(prompts, SamplingParams(max_new_tokens=6, do_sample=False))


def test_sharded_ranks_stop_together_when_one_ranks_logits_hold_nan(tokenizer):
    """Sharded, each decode step all-reduces (done, failed): the rank whose logits held NaN and the ranks waiting
    on it stop at the same step, each with an error, rather than the others waiting in the next collective."""
    from rlhf_core.rollout.hf import HFRolloutEngine, NonFiniteLogits

    prompts = Batch(left_pad([[5, 6], [5]], tokenizer.pad_token_id), {"uid": [0, 1]})
    params = SamplingParams(max_new_tokens=6, do_sample=True)
    # this rank's own rows are fine; another rank reports a failure at the second step
    seen = []
    fine = _EosAfter(stop_at=[99], eos_id=tokenizer.eos_token_id)
    fine.generation_config = None
    engine = HFRolloutEngine(fine, tokenizer, synced=lambda done, failed: seen.append((done, failed)) or
                             (done, len(seen) == 2))
    with pytest.raises(NonFiniteLogits, match="another rank's policy logits held NaN .* response token 1"):
        engine.generate(prompts, params)
    assert seen == [(False, False), (False, False)] and fine.calls == 2  # the prompts' pass and one decode step
    # the rank whose row 1 turns NaN at the first decode step tells the others, and names its row
    seen.clear()
    broken = _NanAt(row=1, step=1, eos_id=tokenizer.eos_token_id)
    broken.generation_config = None
    engine = HFRolloutEngine(broken, tokenizer, synced=lambda done, failed: seen.append((done, failed)) or
                             (done, failed))
    with pytest.raises(NonFiniteLogits, match="response token 1 of rows 1, so"):
        engine.generate(prompts, params)
    assert seen == [(False, False), (False, True)]


def test_preallocated_cache_gives_the_logits_of_dynamic_cache(actor, tokenizer):
    """Prompt pass, repeat for n samples, then decode steps: both caches see the same keys."""
    from transformers import DynamicCache

    prompts = _prompts(tokenizer, ["What is 3+4?", "Hi"])  # left padding in the second row
    ids, mask, pos = prompts["input_ids"], prompts["attention_mask"], prompts["position_ids"]
    steps = torch.randint(3, 40, (4, 5), generator=torch.Generator().manual_seed(0))  # 2 prompts x 2 samples

    arg = make_rollout_engine("hf", actor, tokenizer).cache_arg  # `cache` or `past_key_values`

    def run(cache):
        logits = [actor(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                        **{arg: cache}).logits[:, -1]]
        cache.batch_repeat_interleave(2)
        attention = mask.repeat_interleave(2, dim=0)
        next_pos = pos[:, -1].repeat_interleave(2) + 1
        for step in range(steps.shape[1]):
            attention = torch.cat([attention, torch.ones(4, 1, dtype=attention.dtype)], dim=1)
            out = actor(input_ids=steps[:, step:step + 1], attention_mask=attention,
                        position_ids=(next_pos + step)[:, None], use_cache=True, **{arg: cache})
            logits.append(out.logits[:, -1])
        return logits, cache

    with torch.no_grad():
        expected, _ = run(DynamicCache())
        got, cache = run(PreallocatedCache(ids.shape[1] + steps.shape[1]))
    assert cache.get_seq_length() == ids.shape[1] + steps.shape[1]
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="overflows"), torch.no_grad():  # full: one more position is refused
        actor(input_ids=steps[:, :1], attention_mask=torch.ones(4, cache.get_seq_length() + 1, dtype=torch.long),
              position_ids=torch.full((4, 1), 50), use_cache=True, **{arg: cache})
