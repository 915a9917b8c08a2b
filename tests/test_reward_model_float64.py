"""The learned reward model's path against computations written out here in float64: the Bradley-Terry loss and
its statistics, one training step (loss, accuracy, the head's gradient), the score read at each sequence's last
real token whatever the padding, truncation, and PPO's scoring of rollout rows (alone, in a padded batch, each
prompt once), all compared with a float64 copy of the model run on each sequence alone, without padding."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rewards.reward_model import RewardModelWorker as ScoringWorker
from rlhf_core.training.reward_trainer import (
    RewardModelWorker,
    bradley_terry_loss,
    collate,
    encode_pairs,
    pair_metrics,
    pair_statistics,
    sequence_scores,
)

QUESTIONS = ["3 + 4?", "What is 10 - 3? Think it through.", "1?"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The toy backbone, and two reward models on it with a N(0, 1) head: one with its own pad id, one whose pad id
    is EOS (a tokenizer without a pad token)."""
    root = tmp_path_factory.mktemp("rm64")
    base = random_toy_model(root / "base", n_layers=2, hidden_size=32, max_position_embeddings=512, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(base)
    folders = {}
    for kind, pad_id in (("pad", tokenizer.pad_token_id), ("eos", tokenizer.eos_token_id)):
        config = AutoConfig.from_pretrained(base, num_labels=1)
        config.pad_token_id = pad_id
        torch.manual_seed(7)
        model = AutoModelForSequenceClassification.from_config(config)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 1.0)
        model.save_pretrained(root / kind)
        saved = AutoTokenizer.from_pretrained(base)
        if kind == "eos":
            saved.pad_token = saved.eos_token
        saved.save_pretrained(root / kind)
        folders[kind] = root / kind
    return base, tokenizer, folders


def by_hand(tokenizer, question: str, response: str, eos: bool = True) -> list[int]:
    """The toy chat template's generation prompt written out, the response, EOS: one character a token."""
    text = f"User: {question}\nAssistant: {response}"
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * eos


def float64_scores(model: torch.nn.Module, sequences: list[list[int]], pad_id: int) -> list[float]:
    """Each sequence alone in a float64 copy of ``model``: the head on the hidden state of its last token that is
    not the pad id (transformers' pooling; with pad = EOS, the token before a closing EOS)."""
    reference = copy.deepcopy(model).double().eval()
    weight = reference.score.weight[0]
    scores = []
    with torch.no_grad():
        for ids in sequences:
            last = max(i for i, token in enumerate(ids) if token != pad_id)
            hidden = reference.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # (L, H)
            scores.append(float(hidden[last] @ weight))
    return scores


# ----------------------------------------------------------------------------- the loss and its statistics


def test_bradley_terry_loss_and_pair_statistics_are_the_float64_sums():
    generator = torch.Generator().manual_seed(0)
    chosen = torch.randn(9, generator=generator) * 3
    rejected = torch.randn(9, generator=generator) * 3
    rejected[4] = chosen[4]  # a tie
    weight = torch.tensor([1.0, 1, 0, 1, 1, 0, 1, 1, 1])
    c, r, w, m = chosen.double().tolist(), rejected.double().tolist(), weight.tolist(), 0.75

    def nll(delta):  # -log sigmoid(delta) = log(1 + exp(-delta))
        return math.log1p(math.exp(-delta))

    mean = sum(nll(ci - ri - m) for ci, ri in zip(c, r)) / len(c)
    assert bradley_terry_loss(chosen, rejected, margin=m).item() == pytest.approx(mean, rel=1e-6)
    weighted = sum(wi * nll(ci - ri - m) for ci, ri, wi in zip(c, r, w))
    assert bradley_terry_loss(chosen, rejected, m, weight).item() == pytest.approx(weighted / sum(w), rel=1e-6)
    assert bradley_terry_loss(chosen, rejected, m, weight, normaliser=20).item() == pytest.approx(weighted / 20,
                                                                                                  rel=1e-6)
    stats = pair_statistics(chosen, rejected, m)
    # accuracy counts a pair right only where chosen scores strictly above rejected (TRL's chosen > rejected): a
    # tie is wrong; the margin statistic is r_chosen - r_rejected, the loss's margin m not taken off
    assert stats["correct"] == sum(ci > ri for ci, ri in zip(c, r)) and stats["pairs"] == 9
    assert stats["margin"] == pytest.approx(sum(ci - ri for ci, ri in zip(c, r)), rel=1e-6)
    assert stats["loss"] == pytest.approx(sum(nll(ci - ri - m) for ci, ri in zip(c, r)), rel=1e-6)


def test_a_nan_score_makes_the_scores_range_nan_whichever_micro_batch_holds_it():
    from rlhf_core.training.reward_trainer import merge_statistics

    finite = pair_statistics(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0]))
    broken = pair_statistics(torch.tensor([float("nan")]), torch.tensor([0.0]))
    for parts in ((finite, broken), (broken, finite)):
        total = None
        for part in parts:
            total = merge_statistics(total, part)
        metrics = pair_metrics(total, "val")
        assert all(math.isnan(metrics[f"val/{name}"]) for name in ("score_min", "score_max", "score_std")), metrics
    metrics = pair_metrics(finite, "val")
    assert (metrics["val/score_min"], metrics["val/score_max"]) == (-2.0, 3.0)


# ----------------------------------------------------------------------------- training


def _train_config(base, *extra):
    return load_config([f"reward_model.train.model.path={base}", *extra], validate=False).reward_model.train


def _pairs(tokenizer):
    """Pairs of different lengths, each chosen/rejected sharing its prompt and the start of its response."""
    texts = [(QUESTIONS[0], "3 + 4 = 7\n#### 7", "3 + 4 = 7\n#### 8"),
             (QUESTIONS[1], "#### 7", "10 - 3 = 13 so\n#### 13"),
             (QUESTIONS[2], "abc", "abcd"),
             (QUESTIONS[0], "x", "x y z w")]
    return [(by_hand(tokenizer, q, c), by_hand(tokenizer, q, r)) for q, c, r in texts]


@pytest.mark.parametrize("kind", ["pad", "eos"])
def test_training_reads_each_right_padded_sequence_at_its_last_real_token(dirs, kind):
    base, tokenizer, folders = dirs
    model = AutoModelForSequenceClassification.from_pretrained(folders[kind]).eval()
    pad_id = model.config.pad_token_id
    pairs = _pairs(tokenizer)
    batch = collate(pairs, pad_id)
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    assert batch["input_ids"].shape == (8, max(map(len, rows)))  # right-padded to the longest
    with torch.no_grad():
        got = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    expected = float64_scores(model, rows, pad_id)
    assert got.tolist() == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 0.1  # the rows really score apart


def test_a_training_step_is_the_float64_bradley_terry_step(dirs):
    """Loss, accuracy and the head's gradient of one step over uneven micro-batches (3 + 1 pairs) with a margin:
    ``d/dw mean_i -log sigmoid(w . (h_c,i - h_r,i) - m) = mean_i -sigmoid(m - delta_i) (h_c,i - h_r,i)``."""
    base, tokenizer, _ = dirs
    pad_id = tokenizer.pad_token_id
    worker = RewardModelWorker(_train_config(base, "reward_model.train.margin=0.5", "reward_model.train.grad_clip=1e9",
                                             "reward_model.train.micro_batch_size_per_gpu=3"), pad_id, total_steps=4)
    with torch.no_grad():
        worker.module.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    pairs = _pairs(tokenizer)
    reference = copy.deepcopy(worker.module).double().eval()
    weight = reference.score.weight[0].detach()
    with torch.no_grad():
        hidden = [[reference.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] for ids in pair]
                  for pair in pairs]
    deltas = [float((hc - hr) @ weight) for hc, hr in hidden]
    n, m = len(pairs), 0.5
    loss = sum(math.log1p(math.exp(m - d)) for d in deltas) / n
    gradient = sum(-(hc - hr) / (1 + math.exp(d - m)) for (hc, hr), d in zip(hidden, deltas)) / n  # (H,)
    seen = []  # the head's gradient of each micro-batch's backward, summed below
    worker.module.score.weight.register_hook(lambda grad: seen.append(grad[0].double()))
    sums = worker.train_step(pairs, [1.0] * n, n)
    assert len(seen) == 2 and sums["pairs"] == n and sums["loss"] / n == pytest.approx(loss, rel=1e-5)
    assert sums["correct"] == sum(d > 0 for d in deltas) and sums["margin"] == pytest.approx(sum(deltas), abs=1e-4)
    assert float((sum(seen) - gradient).abs().max()) < 1e-6 * max(1.0, float(gradient.abs().max()))
    # the scores of the step's pairs, as they stood before it, over both micro-batches
    scores = [(float(hc @ weight), float(hr @ weight)) for hc, hr in hidden]
    assert pair_metrics(sums, "train") == pytest.approx(expected_pair_metrics("train", scores, m), abs=1e-5)


def expected_pair_metrics(split: str, scores: list[tuple[float, float]], margin: float) -> dict[str, float]:
    """The pair metrics of (chosen, rejected) scores, worked out here in float64 over every pair at once."""
    flat = [score for pair in scores for score in pair]
    mean = sum(flat) / len(flat)
    values = {"loss": sum(math.log1p(math.exp(margin - c + r)) for c, r in scores) / len(scores),
              "pair_accuracy": sum(c > r for c, r in scores) / len(scores),
              "margin_mean": sum(c - r for c, r in scores) / len(scores),
              "chosen_score_mean": sum(c for c, _ in scores) / len(scores),
              "rejected_score_mean": sum(r for _, r in scores) / len(scores), "score_mean": mean,
              "score_std": math.sqrt(sum((s - mean) ** 2 for s in flat) / len(flat)),
              "score_min": min(flat), "score_max": max(flat)}
    return {f"{split}/{name}": value for name, value in values.items()}


def test_held_out_score_metrics_cover_every_kept_pair_of_uneven_micro_batches(dirs):
    """Micro-batches of 3 + 1 pairs, one of the first left out with weight 0 (a rank's padding): the scores'
    means weigh each kept pair alike, the max and min are over every kept score, whichever micro-batch holds it,
    and the left-out pair, which holds the highest score of all, counts nowhere."""
    base, tokenizer, _ = dirs
    pad_id = tokenizer.pad_token_id
    worker = RewardModelWorker(_train_config(base, "reward_model.train.margin=0.5",
                                             "reward_model.train.micro_batch_size_per_gpu=3"), pad_id, total_steps=1)
    with torch.no_grad():
        worker.module.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    pairs = _pairs(tokenizer)
    scores = list(zip(*[iter(float64_scores(worker.module, [ids for pair in pairs for ids in pair], pad_id))] * 2))
    order = sorted(range(4), key=lambda i: max(scores[i]))  # the highest-scoring pair last
    dropped = order.pop()
    lowest = min(order, key=lambda i: min(scores[i]))
    order.remove(lowest)
    layout = [*order, dropped, lowest]  # micro-batches [kept, kept, dropped] and [the kept lowest score]
    sums = worker.evaluate([pairs[i] for i in layout], [1.0, 1.0, 0.0, 1.0])
    kept = [scores[i] for i in (*order, lowest)]
    expected = expected_pair_metrics("val", kept, 0.5)
    assert pair_metrics(sums, "val") == pytest.approx(expected, abs=1e-5)
    assert max(scores[dropped]) > expected["val/score_max"]  # the left-out pair would have moved it
    assert min(scores[lowest]) == expected["val/score_min"]  # held by the one-pair micro-batch


def float64_step(module: torch.nn.Module, pairs: list, margin: float) -> tuple[dict[str, torch.Tensor], list]:
    """The gradient of the mean Bradley-Terry loss of ``pairs``, each sequence run alone in a float64 copy of
    ``module`` and read at its last token, by parameter name; and the pairs' (chosen, rejected) scores."""
    reference = copy.deepcopy(module).double().eval()
    weight = reference.score.weight[0]
    scores = [[reference.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1] @ weight for ids in pair]
              for pair in pairs]
    # -log sigmoid(r_c - r_r - m) = log(1 + exp(m - r_c + r_r))
    loss = sum(torch.log1p(torch.exp(margin - chosen + rejected)) for chosen, rejected in scores) / len(pairs)
    loss.backward()
    gradient = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    return gradient, [(chosen.item(), rejected.item()) for chosen, rejected in scores]


def gradients_at_step(worker: RewardModelWorker) -> list[dict[str, torch.Tensor]]:
    """Each gradient ``worker``'s optimizer steps on (after clipping), by parameter name, as it steps: a hook, so
    that a skipped step records nothing."""
    seen = []
    worker.optimizer.register_step_pre_hook(lambda *_: seen.append(
        {name: p.grad.double().clone() for name, p in worker.module.named_parameters() if p.grad is not None}))
    return seen


def assert_same_gradient(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient within 1e-4 of the largest entry: float32 backward is good to a few 1e-6 here."""
    assert got.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    error = max(float((got[name] - g).abs().max()) for name, g in expected.items())
    assert error < 1e-4 * scale, (error, scale)


def test_the_optimizer_steps_on_the_gradient_clipped_to_grad_clip(dirs):
    """reward_model.train.grad_clip=0.01 against a gradient far larger: the step is taken along the float64
    gradient scaled to norm 0.01, and train/grad_norm reports the norm before clipping."""
    base, tokenizer, _ = dirs
    worker = RewardModelWorker(_train_config(base, "reward_model.train.grad_clip=0.01"), tokenizer.pad_token_id, 1)
    with torch.no_grad():
        worker.module.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    pairs = _pairs(tokenizer)
    gradient, _ = float64_step(worker.module, pairs, 0.0)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in gradient.values()))
    assert norm > 10 * 0.01  # clipping has work to do
    seen = gradients_at_step(worker)
    sums = worker.train_step(pairs, [1.0] * 4, 4)
    assert sums["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert len(seen) == 1
    assert math.sqrt(sum(float(g.pow(2).sum()) for g in seen[0].values())) == pytest.approx(0.01, rel=1e-4)
    assert_same_gradient(seen[0], {name: g * 0.01 / norm for name, g in gradient.items()})


def test_a_training_step_leaves_out_the_weight_0_pairs_of_each_micro_batch(dirs):
    """Micro-batches of 2 + 2 pairs, the third pair left out with weight 0 (a rank's padding): the step's
    gradient and its pair metrics are those of the three kept pairs alone, the left-out pair in neither."""
    base, tokenizer, _ = dirs
    worker = RewardModelWorker(_train_config(base, "reward_model.train.margin=0.5", "reward_model.train.grad_clip=1e9",
                                             "reward_model.train.micro_batch_size_per_gpu=2"),
                               tokenizer.pad_token_id, total_steps=1)
    with torch.no_grad():
        worker.module.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    pairs = _pairs(tokenizer)
    kept = [pairs[0], pairs[1], pairs[3]]
    gradient, scores = float64_step(worker.module, kept, 0.5)
    seen = gradients_at_step(worker)
    sums = worker.train_step(pairs, [1.0, 1.0, 0.0, 1.0], 3)
    assert sums["pairs"] == 3 and len(seen) == 1
    assert pair_metrics(sums, "train") == pytest.approx(expected_pair_metrics("train", scores, 0.5), abs=1e-5)
    assert_same_gradient(seen[0], gradient)


def test_a_head_that_scores_every_sequence_alike_ranks_no_pair_right(dirs):
    """Ties count as wrong orderings: a zero head (every score 0) ranks 0% of the pairs right at a loss of
    log(1 + e^m) each, whatever the pairs."""
    base, tokenizer, _ = dirs
    worker = RewardModelWorker(_train_config(base, "reward_model.train.margin=0.25"), tokenizer.pad_token_id, 1)
    with torch.no_grad():
        worker.module.score.weight.zero_()
    sums = worker.evaluate(_pairs(tokenizer), [1.0] * 4)
    assert sums == pytest.approx({"loss": 4 * math.log1p(math.exp(0.25)), "correct": 0.0, "margin": 0.0,
                                  "pairs": 4.0, "chosen_score": 0.0, "rejected_score": 0.0, "score_square": 0.0,
                                  "score_max": 0.0, "score_min": 0.0})


def test_truncation_keeps_the_end_of_each_side_in_one_prompt_window(dirs):
    """Over ``max_length`` a pair loses the prompt tokens its longer side must lose, on both sides, so that chosen and
    rejected are read in the same context (the Bradley-Terry model compares two responses to one prompt); each keeps
    its end, where the score is read. A pair left with the same ids on both sides is left out."""
    _, tokenizer, _ = dirs
    rows = [(QUESTIONS[1], "a long chosen answer\n#### 7", "#### 8"),  # 51-token prompt + 28 or + 7: 79 and 58
            (QUESTIONS[0], "yes #### 7", "no! #### 7")]  # 24-token prompt + 11: uncut; the same last 6 tokens
    frame = pd.DataFrame({"prompt": [[{"role": "user", "content": q}] for q, _, _ in rows],
                          "chosen": [c for _, c, _ in rows], "rejected": [r for _, _, r in rows]})
    encoded = encode_pairs([("pairs.parquet", frame)], tokenizer, 38)
    prompt = by_hand(tokenizer, rows[0][0], "", eos=False)
    assert len(prompt) == 51
    window = prompt[41:]  # 79 - 38 = 41 tokens off the prompt of both sides
    first = tuple(window + tokenizer(side, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                  for side in rows[0][1:])
    second = tuple(by_hand(tokenizer, rows[1][0], side) for side in rows[1][1:])
    assert encoded.pairs == [first, second]
    assert tokenizer.decode(first[0]) == "ssistant: a long chosen answer\n#### 7</s>"  # 38 tokens
    assert tokenizer.decode(first[1]) == "ssistant: #### 8</s>"  # 17 tokens: the same context
    assert encoded.identical == [] and (encoded.prompt_cut, encoded.response_cut) == (2, 0)
    cut = encode_pairs([("pairs.parquet", frame.iloc[1:])], tokenizer, 6)
    assert cut.pairs == [] and cut.identical == [("pairs.parquet", 0, True)] and cut.response_cut == 2
    # responses longer than max_length on their own (28 and 7 tokens, 6 kept): no prompt left, each side its last 6
    both = encode_pairs([("pairs.parquet", frame.iloc[:1])], tokenizer, 6)
    assert [tokenizer.decode(ids) for ids in both.pairs[0]] == ["### 7</s>", "### 8</s>"]
    assert (both.prompt_cut, both.response_cut) == (0, 2)


def test_a_tool_call_list_read_from_parquet_reaches_the_template_as_a_list(tmp_path):
    from rlhf_core.models.toy import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% for c in m.tool_calls or [] %}<call {{ c.name }}>{% endfor %}|{% endfor %}Assistant: ")
    prompt = [{"role": "user", "content": "add", "tool_calls": None},
              {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": "{}"}]},
              {"role": "user", "content": "so?", "tool_calls": None}]
    pd.DataFrame({"prompt": [prompt], "chosen": ["3"], "rejected": ["4"]}).to_parquet(tmp_path / "p.parquet")
    frame = pd.read_parquet(tmp_path / "p.parquet")  # the list inside the message as a NumPy array
    encoded = encode_pairs([("p.parquet", frame)], tok, None)
    context = "user: add|assistant: <call add>|user: so?|Assistant: "
    assert [tok.decode(ids) for ids in encoded.pairs[0]] == [context + "3</s>", context + "4</s>"]


# ----------------------------------------------------------------------------- PPO's scoring


def _rollout(tokenizer, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """A rollout batch written out by hand: prompts left-padded, responses right-padded with two all-padding
    columns after the longest, positions counting the valid tokens."""
    width_p, width_r = max(map(len, prompts)), max(map(len, responses)) + 2
    rows = len(prompts)
    prompt_ids = torch.full((rows, width_p), pad_id)
    response_ids = torch.full((rows, width_r), pad_id)
    mask = torch.zeros((rows, width_p + width_r), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, width_p - len(p):] = torch.tensor(p)
        mask[i, width_p - len(p):width_p] = 1
        if r:
            response_ids[i, :len(r)] = torch.tensor(r)
            mask[i, width_p:width_p + len(r)] = 1
    positions = torch.zeros_like(mask)
    for i, (p, _) in enumerate(zip(prompts, responses)):
        positions[i, width_p - len(p):] = torch.arange(width_p + width_r - (width_p - len(p)))
    meta = {"data_source": ["synthetic/arithmetic"] * rows, "ground_truth": ["7"] * rows, "extra_info": [{}] * rows}
    return Batch({"prompts": prompt_ids, "responses": response_ids, "response_mask": mask[:, width_p:],
                  "input_ids": torch.cat([prompt_ids, response_ids], 1), "attention_mask": mask,
                  "position_ids": positions}, meta)


@pytest.mark.parametrize("kind", ["pad", "eos"])
def test_ppo_scores_each_rollout_row_as_the_float64_forward_of_its_conversation(dirs, kind):
    """Three prompts of different lengths, two responses each (one cut at the length limit without EOS, one that
    is EOS alone): every row's score, alone, in the padded batch, micro-batched, and with each prompt run once,
    is the float64 forward of prompt (the chat template as training lays it out) + response + EOS."""
    base, tokenizer, folders = dirs
    answers = [("3 + 4 = 7\n#### 7", True), ("#### 8", False), ("10 - 3 = 7\n#### 7", True), ("", True),
               ("#### 1", True), ("1 so\n####", False)]
    questions = [QUESTIONS[i // 2] for i in range(6)]
    prompts = [by_hand(tokenizer, q, "", eos=False) for q in questions]
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * ended
                 for text, ended in answers]
    whole = [by_hand(tokenizer, q, text, eos=ended) for q, (text, ended) in zip(questions, answers)]
    assert whole == [p + r for p, r in zip(prompts, responses)]
    # training's own layout of the same conversations: the ids scored here are those it trains on
    frame = pd.DataFrame({"prompt": [[{"role": "user", "content": q}] for q in questions[::2]],
                          "chosen": [answers[i][0] for i in (0, 2, 4)], "rejected": [answers[i][0] + "!" for i in (0, 2, 4)]})
    trained = encode_pairs([("p", frame)], tokenizer, 512).pairs
    assert [chosen for chosen, _ in trained] == [whole[i] for i in (0, 2, 4)]

    model = AutoModelForSequenceClassification.from_pretrained(folders[kind])
    pad_id = model.config.pad_token_id
    expected = float64_scores(model, whole, pad_id)
    batch = _rollout(tokenizer, prompts, responses, pad_id)
    for shared in (False, True):
        for micro in (1, 4, 6):
            config = load_config([f"reward_model.model.path={folders[kind]}", f"reward_model.model.input_tokenizer={base}",
                                  f"reward_model.micro_batch_size_per_gpu={micro}", "reward_model.enable=true",
                                  f"reward_model.model.use_shared_prefix={shared}"], validate=False).reward_model
            worker = ScoringWorker(config)
            assert worker.shared_prefix == shared and not worker.switch_template
            assert worker.compute_rm_score(batch).tolist() == pytest.approx(expected, abs=1e-5), (shared, micro)
        alone = [worker.compute_rm_score(_rollout(tokenizer, [p], [r], pad_id)).item()
                 for p, r in zip(prompts, responses)]
        assert alone == pytest.approx(expected, abs=1e-5), shared
    assert len({round(s, 3) for s in expected}) == 6  # six different scores


def test_a_reward_model_that_closes_responses_with_another_eos_scores_them_as_it_was_trained(dirs, tmp_path):
    """A reward model whose tokenizer has the policy's vocabulary and chat template but another EOS (a base model's
    tokenizer against its instruct policy's) was trained on responses closed with its own EOS: PPO re-encodes the
    policy's responses so, rather than read its score at the policy's stop token, where it never trained."""
    base, tokenizer, folders = dirs
    model = AutoModelForSequenceClassification.from_pretrained(folders["pad"])
    model.save_pretrained(tmp_path / "rm")
    own_eos = AutoTokenizer.from_pretrained(folders["pad"])
    own_eos.eos_token = "<unk>"  # id 3; the policy stops on </s>, id 2
    own_eos.save_pretrained(tmp_path / "rm")
    assert own_eos.get_vocab() == tokenizer.get_vocab() and own_eos.chat_template == tokenizer.chat_template
    questions, answers = QUESTIONS[:2], ["3 + 4 = 7\n#### 7", "#### 8"]
    trained = [by_hand(tokenizer, q, a, eos=False) + [3] for q, a in zip(questions, answers)]
    policy = [by_hand(tokenizer, q, a) for q, a in zip(questions, answers)]  # closed with id 2
    expected = float64_scores(model, trained, model.config.pad_token_id)
    assert not expected == pytest.approx(float64_scores(model, policy, model.config.pad_token_id), abs=1e-3)
    batch = _rollout(tokenizer, [by_hand(tokenizer, q, "", eos=False) for q in questions],
                     [ids[len(by_hand(tokenizer, q, "", eos=False)):] for q, ids in zip(questions, policy)],
                     tokenizer.pad_token_id)
    batch.meta["raw_prompt"] = [[{"role": "user", "content": q}] for q in questions]
    config = load_config([f"reward_model.model.path={tmp_path / 'rm'}", f"reward_model.model.input_tokenizer={base}",
                          "reward_model.enable=true"], validate=False).reward_model
    worker = ScoringWorker(config)
    assert worker.switch_template
    assert worker.compute_rm_score(batch).tolist() == pytest.approx(expected, abs=1e-5)
