"""Several workers on CPU (gloo): FSDP2 updates equal one worker's, generation stays in step when
one rank finishes first, and the Ray worker group trains, checkpoints, resumes and fails fast.

Everything runs on one local Ray cluster of 2 CPUs: a group of two test workers (FSDP2 checks,
batch layouts, a worker dying in a collective), then the trainer with two workers. What the driver's side
of the actor and critic groups does with the ranks' shares (layouts, padding, skipped steps) is checked
against ranks faked in this process, without Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.batch import Batch
from rlhf_core.config import load_config
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import SamplingParams
from rlhf_core.training import checkpoint
from rlhf_core.workers import distributed
from rlhf_core.workers.group import (
    ActorGroup,
    CriticGroup,
    DistributedWorker,
    balanced_order,
    minibatch_shares,
    split_evenly,
)

WORLD = 2


def _config(model, *extra):
    return load_config([
        f"actor_rollout_ref.model.path={model}", "data.train_batch_size=4", "data.max_prompt_length=16",
        "data.max_response_length=6", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-2", "actor_rollout_ref.actor.grad_clip=0.05",
        "critic.grad_clip=0.05", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "critic.model.enable_gradient_checkpointing=false",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", *extra,
    ])


def rollout_batch(n_rows: int = 8, prompt_len: int = 5, response_len: int = 6, seed: int = 0,
                  empty: tuple[int, ...] = ()) -> Batch:
    """A fixed rollout batch (no sampling): left-padded prompts, responses of varied lengths, and the
    old log-probs, advantages, returns and values a PPO update needs. ``empty``: rows whose response counts
    for nothing (its mask all zeros, as rollout rejection leaves a row), so that workers hold unequal numbers
    of responses as well as of tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_valid = torch.randint(2, prompt_len + 1, (n_rows,), generator=g)
    response_valid = torch.randint(1, response_len + 1, (n_rows,), generator=g)
    prompts = torch.randint(4, 90, (n_rows, prompt_len), generator=g)
    responses = torch.randint(4, 90, (n_rows, response_len), generator=g)
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_valid[:, None]).long()
    response_mask = (torch.arange(response_len) < response_valid[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    response_mask[list(empty)] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    shape = (n_rows, response_len)
    return Batch({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": position_ids,
        "old_log_prob": -4.5 + 0.3 * torch.randn(shape, generator=g),
        "ref_log_prob": -4.5 + 0.3 * torch.randn(shape, generator=g),
        "advantages": torch.randn(shape, generator=g), "returns": torch.randn(shape, generator=g),
        "values": 0.1 * torch.randn(shape, generator=g),
    })


# the actor trains all weights (its reference is a sharded copy); the critic trains LoRA adapters and its head
UPDATE_OVERRIDES = ("critic.model.lora_rank=4", "critic.model.lora_alpha=8")


def one_update(cfg, tokenizer, batch: Batch, n: int, shares: Batch | None = None) -> dict:
    """Log-probs, values, one actor and one critic update, the values after it (the value head starts at zero, so
    the values before it are zeros on any layout); the full weights after it (rank 0)."""
    from rlhf_core.workers.actor import ActorWorker
    from rlhf_core.workers.critic import CriticWorker

    resolved = cfg.resolved()
    actor = ActorWorker(resolved.actor_rollout_ref, tokenizer, total_steps=1, need_ref=True, seed=0)
    critic = CriticWorker(resolved.critic, "float32", 1, seed=0)
    local = shares if shares is not None else batch
    log_prob, entropy = actor.compute_log_prob(local)
    values = critic.compute_values(local)
    actor_metrics = actor.update_policy(local, n)
    critic_metrics = critic.update_critic(local, n)
    values_after = critic.compute_values(local)
    return {"log_prob": log_prob, "entropy": entropy, "values": values, "values_after": values_after,
            "actor_metrics": actor_metrics,
            "critic_metrics": critic_metrics, "actor": distributed.full_state_dict(actor.module),
            "critic": distributed.full_state_dict(critic.module), "skipped": actor.skipped_steps, "worker": actor}


def _steering_hook(token_id: int, force: bool):
    """A forward hook that makes ``token_id`` the argmax (``force``) or impossible (not ``force``)."""
    def hook(module, args, output):
        output.logits[..., token_id] = 1e4 if force else -1e4
        return output
    return hook


class _TestWorker(DistributedWorker):
    """A rank of the test group (the class travels to the workers by value)."""

    def fsdp_update_and_generate(self, model: str, balance: bool = False, extra: tuple[str, ...] = (),
                                 empty: tuple[int, ...] = ()) -> dict:
        """The sharded update on this rank's share (laid out by tokens with ``balance``; ``extra`` overrides;
        ``empty`` as :func:`rollout_batch`'s); then a generation in which rank 0's responses end at their first
        token while rank 1's run to the length limit."""
        cfg = _config(model, *UPDATE_OVERRIDES, *extra)
        tokenizer = load_tokenizer(model)
        batch, n = rollout_batch(empty=empty), cfg.actor_rollout_ref.rollout.n
        mini_rows = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
        result = one_update(cfg, tokenizer, batch, n, minibatch_shares(batch, mini_rows, WORLD, balance)[self.rank])
        actor = result.pop("worker")
        from rlhf_core.rollout import hf

        hf.FUSED_DECODE = False  # every token from the module's forward, where the hook steers it
        hook = actor.forward_module.register_forward_hook(
            _steering_hook(tokenizer.eos_token_id, force=self.rank == 0))
        mine = slice(2 * self.rank, 2 * self.rank + 2)  # two prompts per rank, two samples each
        prompts = Batch({"input_ids": batch["prompts"][mine], "attention_mask": batch["attention_mask"][mine, :5],
                         "position_ids": batch["position_ids"][mine, :5]})
        result["generated_mask"] = actor.generate(prompts, SamplingParams(n=2, max_new_tokens=6))["response_mask"]
        hook.remove()
        return result

    def rows(self, share: Batch) -> list[int]:
        return [self.rank, *share["row"].tolist()]

    def sleep_on(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    def sleep_share(self, share: Batch, rank: int, seconds: float) -> int:
        return self.sleep_on(rank, seconds)

    def lora_update_and_save_adapter(self, model: str, folder: str) -> dict[str, torch.Tensor]:
        """An actor with LoRA updated on this rank's share, its peft adapter saved into ``folder``; the whole
        weights after the update (rank 0; {} on the others)."""
        from rlhf_core.workers.actor import ActorWorker

        cfg = _config(model, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
        batch, n = rollout_batch(), cfg.actor_rollout_ref.rollout.n
        actor = ActorWorker(cfg.resolved().actor_rollout_ref, load_tokenizer(model), total_steps=1, need_ref=False)
        mini_rows = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
        actor.update_policy(minibatch_shares(batch, mini_rows, WORLD)[self.rank], n)
        actor.save_adapter(folder)
        return distributed.full_state_dict(actor.module)

    def die_during_all_reduce(self, dying_rank: int) -> float:
        if self.rank == dying_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.ones(1)
        torch.distributed.all_reduce(total)  # the other rank waits here for a peer that is gone
        return float(total)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    return str(random_toy_model(root / "model", n_layers=2, hidden_size=32, max_position_embeddings=512, seed=0))


@pytest.fixture(scope="module")
def ray_cluster(ray_cluster):
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's worker class, by value
    return ray_cluster


@pytest.fixture(scope="module")
def test_group(ray_cluster):
    from rlhf_core.workers.group import WorkerGroup

    group = WorkerGroup(_TestWorker, WORLD, device="cpu")
    yield group
    group.shutdown()


@pytest.mark.parametrize(("balance", "loss_agg_mode", "empty"), [
    (False, "token-mean", ()), (True, "token-mean", ()), (False, "seq-mean-token-sum", (0, 4)),
    (False, "seq-mean-token-mean", (0, 4)), (False, "seq-mean-token-sum-norm", (0, 4))],
    ids=["as_the_rows_come", "balanced_by_tokens", "seq_mean_token_sum", "seq_mean_token_mean",
         "seq_mean_token_sum_norm"])
def test_fsdp2_update_on_two_workers_equals_one_worker_and_generation_stays_in_step(test_group, model_dir, balance,
                                                                                    loss_agg_mode, empty):
    """Actor (full weights, reference copy) and critic (LoRA): the same log-probs, values, metrics and
    weights after an update with grad clipping active, on one worker and on two, whether the ranks take
    each mini-batch's rows as they come or laid out by tokens (trainer.balance_batch), and whether the losses
    are divided by the mini-batch's tokens or by its responses (loss_agg_mode, the critic's following the actor's):
    by the counts over both ranks, as one worker counts them. Where the losses count responses, rows 0 and 4
    (rank 0's, as the rows come) hold none, so the ranks' counts differ: a count taken from one rank and
    multiplied out would pass with equal counts."""
    from transformers import AutoModelForCausalLM

    # a value clip range small enough that a good share of the critic's tokens is clipped (the clip fraction then
    # tells a wrong aggregation from the right one)
    extra = (f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode}", "critic.cliprange_value=0.05")
    ranks = test_group.execute_all("fsdp_update_and_generate", model_dir, balance, extra, empty)
    cfg = _config(model_dir, *UPDATE_OVERRIDES, *extra)
    batch, n = rollout_batch(empty=empty), cfg.actor_rollout_ref.rollout.n
    single = one_update(cfg, load_tokenizer(model_dir), batch, n)

    # log-probs and values of the shares, gathered in rank order, are the single worker's (the shares
    # interleave mini-batches: undo that layout to compare row by row)
    mini_rows = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
    layout = minibatch_shares(Batch({"row": torch.arange(len(batch)), "attention_mask": batch["attention_mask"]}),
                              mini_rows, WORLD, balance)
    rows = torch.cat([share["row"] for share in layout])
    if balance:  # rows of 4 to 10 tokens: the balanced layout is another than the rows as they come
        plain = minibatch_shares(Batch({"row": torch.arange(len(batch))}), mini_rows, WORLD)
        assert rows.tolist() != torch.cat([share["row"] for share in plain]).tolist()
    assert single["values_after"].abs().max() > 0.05  # moved off the zero head: row order and scale show
    for key in ("log_prob", "entropy", "values", "values_after"):
        gathered = torch.cat([r[key] for r in ranks])
        torch.testing.assert_close(gathered, single[key][rows], rtol=1e-5, atol=1e-6, msg=key)
    # the clip is active (grad norm above grad_clip), so the total norm over the shards matters
    assert single["actor_metrics"]["actor/grad_norm"] > 0.05 and single["critic_metrics"]["critic/grad_norm"] > 0.05
    assert single["critic_metrics"]["critic/vf_clipfrac"] > 0.2 and single["actor_metrics"]["actor/pg_clipfrac"] > 0.2
    for role in ("actor_metrics", "critic_metrics"):
        for name, value in single[role].items():
            # (the value clip fraction too: a mean over ranks taken unweighted is 0.001-0.012 off it here)
            assert ranks[0][role][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for role in ("actor", "critic"):
        sharded = ranks[0][role]
        assert sharded.keys() == single[role].keys()
        for name, value in single[role].items():
            torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=1e-6, msg=f"{role} {name}")
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.allclose(single["actor"][name], initial[name]) for name in initial)  # the update moved

    # generation: rank 0 stopped after one token, rank 1 ran to the limit; both ran the same steps
    assert ranks[0]["generated_mask"].sum(-1).tolist() == [1] * 4
    assert ranks[1]["generated_mask"].sum(-1).tolist() == [6] * 4
    assert ranks[0]["generated_mask"].shape == ranks[1]["generated_mask"].shape == (4, 6)


def test_a_sharded_lora_actor_saves_its_whole_adapter_once_as_peft_does(test_group, model_dir, tmp_path):
    """Rank 0 gathers the adapters' shards and writes the folder peft writes; peft's from_pretrained over the
    plain base model holds the whole trained adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "lora_adapter"
    whole = test_group.execute_all("lora_update_and_save_adapter", model_dir, str(folder))[0]
    assert sorted(file.name for file in folder.iterdir()) == ["README.md", "adapter_config.json",
                                                              "adapter_model.safetensors"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder).state_dict()
    adapters = {name: tensor for name, tensor in whole.items() if ".lora_" in name}
    assert adapters and {name for name in adapted if ".lora_" in name} == set(adapters)
    for name, tensor in adapters.items():
        assert tensor.shape == adapted[name].shape and torch.equal(adapted[name], tensor), name
    assert any(".lora_B." in name and tensor.abs().max() > 0 for name, tensor in adapters.items())  # trained


class FakeRanks:
    """``world_size`` ranks in this process, standing for a worker group where only the driver's side of
    ActorGroup and CriticGroup is checked (no Ray): each call's shares are kept, and each rank answers as a
    worker does: its prompts each sampled ``n`` times; an update's (metrics, optimizer steps it skipped, one);
    per row, the row's id times 10 (and, for log-probs, the row's tokens beside it as its entropy)."""

    def __init__(self, world_size: int = WORLD):
        self.world_size = world_size
        self.calls: list[list[Batch]] = []  # each call's shares, in rank order

    def dispatch(self, method, shares, *args, kind=None, **kwargs):
        self.calls.append(shares)
        if method == "generate":
            n = args[0].n
            return [Batch({"row": s["row"].repeat_interleave(n), "responses": torch.zeros(len(s) * n, 3)})
                    for s in shares]
        if method == "update":
            return [({"loss": 0.5}, 1) for _ in shares]
        if method == "compute_log_prob":
            return [(s["row"] * 10, s["attention_mask"].sum(-1)) for s in shares]
        return [s["row"] * 10 for s in shares]

    def rows(self) -> list[list[int]]:
        """The rows each rank got in the last call."""
        return [s["row"].tolist() for s in self.calls[-1]]

    def tokens(self) -> list[int]:
        """The tokens each rank got in the last call."""
        return [int(s["attention_mask"].sum()) for s in self.calls[-1]]


def rows_of(lengths: list[int]) -> Batch:
    """One row per length, its id in "row" and that many tokens in its attention mask."""
    return Batch({"row": torch.arange(len(lengths)),
                  "attention_mask": torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])})


def test_balanced_layouts_by_hand():
    # greedy, longest first, each row to the emptier share with room: 10 -> a, 9 -> b, 8 -> b, 3 -> a, 2 -> a
    # (a full), 1 -> b: shares [0, 3, 5] (15 tokens) and [1, 2, 4] (18), against 20 and 13 as the rows come
    assert balanced_order([10, 1, 9, 2, 8, 3], 2) == [0, 3, 5, 1, 2, 4]

    # an update's shares: the same rows in each mini-batch of 6 (the same update), balanced within it
    batch = rows_of([10, 1, 9, 2, 8, 3, 1, 1, 1, 1, 1, 10])
    shares = minibatch_shares(batch, mini_rows=6, parts=2, balance=True)
    # (the second mini-batch: 10 goes to the first share, then its ones to the second until it is full)
    assert [s["row"].tolist() for s in shares] == [[0, 3, 5, 9, 10, 11], [1, 2, 4, 6, 7, 8]]
    plain = minibatch_shares(batch, mini_rows=6, parts=2)
    assert [s["row"].tolist() for s in plain] == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]

    ranks = FakeRanks()  # log-probs come back per row: here each row's id and its tokens
    role = ActorGroup(ranks, mini_batch_size=3, balance=True)
    batch = rows_of([10, 1, 9, 2, 8, 3])
    ids, tokens = role.compute_log_prob(batch)
    assert ids.tolist() == [0, 10, 20, 30, 40, 50] and tokens.tolist() == [10, 1, 9, 2, 8, 3]  # back in order
    assert len(ranks.calls) == 1 and ranks.tokens() == [15, 18]  # the shares the ranks computed, not 20 and 13
    role.balance = False
    assert role.compute_log_prob(batch)[0].tolist() == [0, 10, 20, 30, 40, 50] and ranks.tokens() == [20, 13]


@pytest.mark.parametrize("role_class, mini_batch_size, balance, lengths, expected", [
    # 2 prompts a mini-batch, 2 samples each: mini-batches of 4 rows, rank r takes the r-th half of each
    (ActorGroup, 2, False, [4] * 8, [[0, 1, 4, 5], [2, 3, 6, 7]]),
    # 3 prompts a mini-batch: mini-batches of 6 rows, each balanced as test_balanced_layouts_by_hand works out
    (CriticGroup, 3, True, [10, 1, 9, 2, 8, 3, 1, 1, 1, 1, 1, 10], [[0, 3, 5, 9, 10, 11], [1, 2, 4, 6, 7, 8]]),
])
def test_an_update_gives_each_rank_its_part_of_every_mini_batch_and_counts_a_skipped_step_once(
        role_class, mini_batch_size, balance, lengths, expected):
    ranks = FakeRanks()
    role = role_class(ranks, mini_batch_size, balance)
    update = role.update_policy if role_class is ActorGroup else role.update_critic
    assert update(rows_of(lengths), n_per_prompt=2) == {"loss": 0.5}
    assert ranks.rows() == expected
    # every rank skipped the same optimizer step: the group skipped one step, not one per rank
    assert role.skipped_steps == 1


def test_the_padding_rows_that_make_even_shares_are_dropped_from_what_comes_back():
    ranks = FakeRanks()
    actor = ActorGroup(ranks, mini_batch_size=2)
    # 3 prompts over 2 ranks: the last prompt is repeated to make shares of 2, and its copy's 2 samples dropped
    rollout = actor.generate(Batch({"row": torch.arange(3)}), SamplingParams(n=2, max_new_tokens=3))
    assert ranks.rows() == [[0, 1], [2, 2]] and rollout["row"].tolist() == [0, 0, 1, 1, 2, 2]
    # 5 rows over 2 ranks: shares [0, 1, 2] and [3, 4, 4], one value per row, the copy's dropped
    assert actor.compute_ref_log_prob(Batch({"row": torch.arange(5)})).tolist() == [0, 10, 20, 30, 40]
    assert ranks.rows() == [[0, 1, 2], [3, 4, 4]]


def test_batch_layouts_for_the_ranks(test_group):
    batch = Batch({"row": torch.arange(8)})
    shares = minibatch_shares(batch, mini_rows=4, parts=2)
    assert [s["row"].tolist() for s in shares] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="cannot be shared evenly"):
        minibatch_shares(batch, mini_rows=3, parts=2)
    chunks, pad = split_evenly(Batch({"row": torch.arange(5)}), 2)
    assert pad == 1 and [c["row"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 4]]
    assert test_group.dispatch("rows", chunks) == [[0, 0, 1, 2], [1, 3, 4, 4]]  # rank order kept


def test_a_rank_still_running_long_after_the_others_is_named_with_its_pid(test_group, monkeypatch, capsys):
    """(Before the dying-worker test, which shuts the group down.) Rank 1 sleeps 2.5 s while rank 0 returns:
    with the notice due after 0.5 s, three notices (at 0.5, 1 and 2 s: the age doubles) name rank 1 and its pid,
    rank 0 as finished and the timeout that would end a hang; the next call of the method waits 3x the previous
    call before one."""
    from rlhf_core.workers import group as group_module

    monkeypatch.setattr(group_module, "STALL_NOTICE_S", 0.5)
    assert test_group.execute_all("sleep_on", 1, 2.5) == [0, 1]
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: sleep_on has run")]
    assert len(notices) == 3 and notices[-1].startswith("notice: sleep_on has run 2 s on rank 1"), notices
    assert f"on rank 1 (pid {test_group.pids[1]}); rank 0 finished it after 0 s" in notices[0]
    assert "actor_rollout_ref.nccl_timeout (1800 s)" in notices[0]
    assert f"py-spy dump --pid {test_group.pids[1]}" in notices[0]
    assert test_group.execute_all("sleep_on", 0, 2.0) == [0, 1]  # under 3 x 2.5 s: no notice
    assert "sleep_on has run" not in capsys.readouterr().err
    # calls of one method that do unlike work (kinds: the actor's and the critic's updates) wait each on its own
    shares = [Batch({"row": torch.tensor([rank])}) for rank in range(WORLD)]
    assert test_group.dispatch("sleep_share", shares, 1, 2.5, kind="slow") == [0, 1]
    capsys.readouterr()
    assert test_group.dispatch("sleep_share", shares, 1, 1.0, kind="quick") == [0, 1]  # no previous call: 0.5 s
    assert "notice: sleep_share has run" in capsys.readouterr().err  # (keyed on the method: none before 7.5 s)
    assert test_group.dispatch("sleep_share", shares, 1, 2.0, kind="slow") == [0, 1]  # under 3 x 2.5 s
    assert "sleep_share has run" not in capsys.readouterr().err


def test_a_worker_dying_in_a_collective_fails_the_call_at_once(test_group):
    from rlhf_core.workers.group import WorkerError

    started = time.perf_counter()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died during die_during_all_reduce"):
        test_group.execute_all("die_during_all_reduce", 1)
    assert time.perf_counter() - started < 30  # not the 30 minutes of the collective's timeout
    with pytest.raises(WorkerError, match="shut down after a failure"):
        test_group.execute_all("rows", Batch({"row": torch.arange(2)}))


def test_more_workers_than_the_cluster_holds_say_why_they_wait(ray_cluster, capsys):
    """3 workers of one CPU on the module's 2-CPU cluster: the wait (an autoscaling cluster may grow) is said at
    once, not after the timeout in silence."""
    from rlhf_core.workers.group import WorkerError, WorkerGroup

    with pytest.raises(WorkerError, match=r"cannot place 3 workers of \{'CPU': 1\} each within 1 s"):
        WorkerGroup(DistributedWorker, 3, placement_timeout_s=1)
    assert "waiting up to 1 s to place 3 workers of {'CPU': 1} each: the Ray cluster has {'CPU': 2.0} now" in \
        capsys.readouterr().err


def test_a_cluster_that_refuses_the_connection_names_the_address(monkeypatch):
    import ray

    from rlhf_core.workers import group
    from rlhf_core.workers.group import WorkerError, ensure_ray

    def refuse(**_):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379: AuthenticationError")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(group, "_what_answers", lambda *_: None)  # Ray answers at the made-up address
    with pytest.raises(WorkerError, match=r"cannot connect to the Ray cluster at trainer.ray_address='10.0.0.9:6379' "
                                          r"\(or RAY_ADDRESS\): Failed to connect .*AuthenticationError; check"):
        ensure_ray("10.0.0.9:6379", 2, "cpu")


def _trainer_overrides(root, model, out):
    return [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=4", "data.val_batch_size=3",
        "data.max_prompt_length=320", "data.max_response_length=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3", "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2",
        "trainer.n_gpus_per_node=2", "trainer.device=cpu", "trainer.val_before_train=false",
        "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=2", "trainer.logger=[]",
        f"trainer.default_local_dir={out}",
    ]


def test_two_ray_workers_train_checkpoint_resume_and_a_failing_worker_stops_the_step(ray_cluster, model_dir,
                                                                                     tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.main_ppo import build_trainer
    from rlhf_core.workers.group import WorkerError

    build_dataset(tmp_path / "data", n_train=8, n_test=3, seed=0, max_ops=1)
    out = tmp_path / "out"
    trainer = build_trainer(load_config([*_trainer_overrides(tmp_path, model_dir, out),
                                         "actor_rollout_ref.nccl_timeout=900"]))
    try:
        assert trainer.worker_group is not None and trainer.worker_group.world_size == 2
        assert trainer.worker_group.collective_timeout_s == 900  # verl's key sets the workers' collective timeout
        history = trainer.fit()
        assert [h.step for h in history] == [1, 2]
        last = history[-1].metrics
        assert all(torch.isfinite(torch.tensor(v)) for v in last.values() if isinstance(v, float))
        assert "val-core/synthetic/arithmetic/acc/mean@1" in last  # 3 prompts over 2 workers: padded, dropped
        # verl's perf/throughput is tokens a second per worker
        assert last["perf/throughput"] == pytest.approx(last["perf/total_num_tokens"] / last["perf/time_per_step"] / 2)
        for step in (1, 2):
            saved = checkpoint.read_manifest(out / f"global_step_{step}")["files"]
            for role in ("actor", "critic"):
                assert f"{role}/extra_state_rank_0.pt" in saved and f"{role}/extra_state_rank_1.pt" in saved
                assert any(name.startswith(f"{role}/dcp/") for name in saved)
        exported = AutoModelForCausalLM.from_pretrained(out / "global_step_2" / "actor" / "huggingface")
        initial = AutoModelForCausalLM.from_pretrained(model_dir)
        assert exported.config.architectures == ["LlamaForCausalLM"]
        changed = [n for n, p in exported.state_dict().items() if not torch.equal(p, initial.state_dict()[n])]
        assert changed  # the export holds the trained weights, gathered from both shards

        # resume from step 1: step 2 again gives the same metrics
        trainer.load_checkpoint(out / "global_step_1")
        assert trainer.global_step == 1
        again = trainer.fit()[-1].metrics
        for name, value in last.items():
            if not name.startswith(("timing_s/", "timing_per_token_ms/", "perf/")):
                assert again[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name

        # rank 1 raises inside generation (a token id outside the vocabulary in its share of the prompts)
        # while rank 0 waits in an FSDP all-gather: the step fails with rank 1's error, not a hang
        collate = trainer.train_dataset.collate

        def poisoned(rows):
            prompts = collate(rows)
            prompts["input_ids"][-1, -1] = 10_000  # the last prompt is rank 1's
            return prompts

        trainer.train_dataset.collate = poisoned
        trainer.total_steps = 3
        started = time.perf_counter()
        with pytest.raises(WorkerError, match=r"(?s)training step 3 failed: worker rank 1 \(pid \d+\) raised in "
                                              r"generate.*IndexError.*global_step_2 is intact"):
            trainer.fit()
        assert time.perf_counter() - started < 60
        assert checkpoint.latest_checkpoint(out) == out / "global_step_2"
        assert json.loads((out / "global_step_2" / "trainer_state.json").read_text())["global_step"] == 2
    finally:
        trainer.close()


def test_relative_paths_reach_workers_that_run_in_another_folder(ray_cluster, model_dir, tmp_path, monkeypatch):
    """The cluster's workers run in the folder the cluster started in, not the driver's: relative model and
    checkpoint paths named other folders there (the checkpoint's manifest listed actor and critic with no shard
    in it, the shards went to the cluster's folder). The driver now sends them absolute. (The actor trains LoRA
    adapters here: its peft adapter folder is written there too.)"""
    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.main_ppo import build_trainer

    build_dataset(tmp_path / "data", n_train=8, n_test=3, seed=0, max_ops=1)
    origin = Path.cwd()  # where the module's cluster started: its workers run here
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "model").symlink_to(model_dir)
    monkeypatch.chdir(driver)
    out = f"out-{tmp_path.name}"  # relative; a name no folder at the origin has
    overrides = [item for item in _trainer_overrides(tmp_path, "model", out)
                 if not item.startswith(("trainer.total_training_steps", "trainer.test_freq"))]
    trainer = build_trainer(load_config([*overrides, "trainer.total_training_steps=1", "trainer.test_freq=-1",
                                         "actor_rollout_ref.model.lora_rank=4"]))
    try:
        trainer.fit()
        saved = checkpoint.read_manifest(driver / out / "global_step_1", verify=True)["files"]
        for role in ("actor", "critic"):
            assert f"{role}/dcp/.metadata" in saved and f"{role}/extra_state_rank_1.pt" in saved
        assert "actor/huggingface/model.safetensors" in saved
        # with LoRA, the adapter as peft saves it, over the model folder as the driver names it
        assert {"actor/lora_adapter/adapter_model.safetensors", "actor/lora_adapter/adapter_config.json"} <= set(saved)
        adapter_config = json.loads((driver / out / "global_step_1" / "actor" / "lora_adapter" /
                                     "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == str(driver / "model")
    finally:
        trainer.close()
        stray = origin / out
        if stray.exists():  # what the old code left at the cluster's folder
            shutil.rmtree(stray)
            pytest.fail(f"the workers wrote into {stray}")


def test_two_ray_workers_take_the_bfloat16_blocks(ray_cluster, model_dir, tmp_path):
    """trainer.cpu_matmul_dtype reaches the sharded workers: their log-probs of the same responses in bfloat16 are
    within bfloat16's rounding of the float32 ones, and not equal to them (float32 twice gives the same bits)."""
    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.main_ppo import build_trainer

    build_dataset(tmp_path / "data", n_train=8, n_test=3, seed=0, max_ops=1)
    batch, log_probs = None, {}
    for run, dtype in enumerate(("float32", "float32", "bfloat16")):
        overrides = _trainer_overrides(tmp_path, model_dir, tmp_path / str(run)) + [f"trainer.cpu_matmul_dtype={dtype}"]
        trainer = build_trainer(load_config(overrides))
        try:
            if batch is None:
                batch = trainer.actor.generate(trainer.train_dataset.collate(list(range(4))), trainer._train_params())
            log_probs.setdefault(dtype, []).append(trainer.actor.compute_log_prob(batch)[0])
        finally:
            trainer.close()
    (full, again), (low,) = log_probs["float32"], log_probs["bfloat16"]
    mask = batch["response_mask"].bool()
    assert torch.equal(full[mask], again[mask])
    assert (low - full)[mask].abs().max() > 1e-5
    torch.testing.assert_close(low[mask], full[mask], rtol=0, atol=1e-2)


class _FullDiskWorker(DistributedWorker):
    """A rank whose shards go to a disk that is full for rank 1 (the class travels to the workers by value)."""

    def save_shards(self, role: str, folder: str) -> None:
        """As a sharded worker saves (torch DCP over the group), rank 1's fsync failing as a full disk's does."""
        import errno

        import torch.distributed.checkpoint as dcp

        if self.rank == 1:
            def full(fd):
                raise OSError(errno.ENOSPC, "No space left on device")
            os.fsync = full  # (this worker's process only; the group ends with the failure)
        dcp.save({"weight": torch.full((4,), float(self.rank))}, checkpoint_id=folder)


def test_a_full_disk_under_a_workers_sharded_save_is_the_one_line_disk_full_error(ray_cluster, tmp_path):
    """With several workers each rank writes its shards: a full disk there came back as the worker's error, a
    traceback of Ray's and torch's many lines inside "worker rank 1 raised in save_shards", not the one line a
    single process gives (disk full, the file, the checkpoint kept and how to go on)."""
    from rlhf_core.workers.group import WorkerGroup

    root = tmp_path / "ckpts"
    checkpoint.write_checkpoint(root, 1, lambda files: files.text("actor/model_state.pt", "kept") or ["actor"])
    group = WorkerGroup(_FullDiskWorker, WORLD, device="cpu")
    try:
        actor = ActorGroup(group, mini_batch_size=2)

        def fill(files):
            files.tree("actor", actor.save_shards)  # as a checkpoint of sharded workers is filled
            return ["actor"]

        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.write_checkpoint(root, 2, fill, rerun="rerun the same command")
    finally:
        group.shutdown()
    assert str(info.value) == (
        f"disk full while writing actor/ of checkpoint {root / 'global_step_2'} (No space left on device); the "
        f"previous checkpoint {root / 'global_step_1'} is intact: free space on that disk, then rerun the same "
        "command to resume from it")
    assert checkpoint.latest_checkpoint(root, verify=True) == root / "global_step_1"
    assert sorted(path.name for path in root.iterdir()) == ["global_step_1", "latest_checkpointed_iteration.txt"]
