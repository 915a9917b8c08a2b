"""PPO checkpoints resume and roll back on another number of workers than saved them: one worker's whole
state is cut into two workers' FSDP2 shards, two workers' shards gather into one worker, the tensors exactly
as saved (read back with torch's own DCP converter), and a resume on another count says what then differs.

One Ray cluster of 2 CPUs; the tiny one-layer PPO run of ``conftest.workspace`` with GAE (actor and critic).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import ConfigError, load_config
from rlhf_core.training import checkpoint
from rlhf_core.workers.actor import ROLLOUT_SEED_STRIDE

pytestmark = pytest.mark.usefixtures("one_thread")
TWO = ("trainer.n_gpus_per_node=2",)
PARTS = ("actor", "critic")


def never(step, metrics) -> bool:  # no validation: it is not what these tests are about
    return False


# shuffled mini-batches and a warm-up, so that the shuffle generators are drawn and the learning rate moves
# between steps: a schedule or generator loaded wrongly shows
DRAWN = ("actor_rollout_ref.actor.shuffle=true", "critic.shuffle=true", "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
         "critic.optim.lr_warmup_steps=4")


def _config(workspace, out, *extra):
    return load_config(workspace.overrides(out, "trainer.total_training_steps=3", "trainer.save_freq=2",
                                           "trainer.logger=[]", *DRAWN, *extra))


def _trainer(workspace, out, *extra):
    from rlhf_core.main_ppo import build_trainer

    return build_trainer(_config(workspace, out, *extra))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster of 2 CPUs, or the one an earlier test left running (a trainer's group starts one)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def one(workspace):
    """One worker, two steps: ``one/global_step_2`` holds each part whole."""
    trainer = _trainer(workspace, workspace.root / "one")
    for _ in range(2):
        trainer.fit_step(validate=never)
    return trainer, workspace.root / "one" / "global_step_2"


@pytest.fixture(scope="module")
def two(workspace, ray_cluster):
    """Two workers, two steps: ``two/global_step_2`` holds each part as DCP shards and one extra state per rank."""
    trainer = _trainer(workspace, workspace.root / "two", *TWO)
    try:
        for _ in range(2):
            trainer.fit_step(validate=never)
        yield trainer, workspace.root / "two" / "global_step_2"
    finally:
        trainer.close()


def _names(worker) -> list[str]:
    """The parameter names in the order the optimizer holds them (the trainable ones, in module order)."""
    return [name for name, param in worker.module.named_parameters() if param.requires_grad]


def _flat(model: dict, optimizer: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """A whole model and a ``optimizer.state_dict()`` (numbered parameters) as one level of tensors by name."""
    order = [i for group in optimizer["param_groups"] for i in group["params"]]
    flat = {f"model.{k}": v for k, v in model.items()}
    for i, name in zip(order, names, strict=True):
        flat.update({f"optimizer.{name}.{k}": v for k, v in optimizer["state"][i].items()})
    return flat


def _whole(folder, names) -> dict[str, torch.Tensor]:
    return _flat(torch.load(folder / "model_state.pt", weights_only=True),
                 torch.load(folder / "optim_state.pt", weights_only=True)["optimizer"], names)


def _gathered(folder, tmp_path) -> dict[str, torch.Tensor]:
    """The shards under ``folder/dcp`` gathered by torch's own converter, not by the code under test."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder / "dcp", target)
    state = torch.load(target, weights_only=False)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for name, moments in state["optimizer"]["state"].items():
        flat.update({f"optimizer.{name}.{k}": v for k, v in moments.items()})
    return flat


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert any(k.endswith(".exp_avg_sq") for k in expected) and any(k.endswith(".step") for k in expected)
    differing = [k for k in expected if not torch.equal(got[k].cpu(), expected[k].cpu())]
    assert differing == [], differing[:5]


def _extra(folder, rank: int | None = None) -> dict:
    """A part's scheduler and generators: one worker's (optim_state.pt's scheduler beside extra_state.pt) or a
    rank's."""
    if rank is not None:
        return torch.load(folder / f"extra_state_rank_{rank}.pt", weights_only=True)
    scheduler = torch.load(folder / "optim_state.pt", weights_only=True)["scheduler"]
    return {"scheduler": scheduler, **torch.load(folder / "extra_state.pt", weights_only=True)}


def assert_same_extra(got: dict, expected: dict, keys=("scheduler", "shuffle_generator", "rollout_generator")):
    for key in keys:
        if key in expected:
            same = torch.equal(got[key], expected[key]) if isinstance(expected[key], torch.Tensor) \
                else got[key] == expected[key]
            assert same, key


def test_the_worker_count_may_change_on_resume_but_batches_must_still_divide(workspace, tmp_path):
    out = tmp_path / "out"
    saved, moved = _config(workspace, out).to_dict(), _config(workspace, out, *TWO).to_dict()
    assert checkpoint.config_differences(saved, moved) == []
    tp = _config(workspace, out, *TWO, "actor_rollout_ref.rollout.tensor_model_parallel_size=2").to_dict()
    assert checkpoint.config_differences(saved, tp) == []  # vLLM's layout over the workers, not the math
    other = _config(workspace, out, *TWO, "actor_rollout_ref.actor.ppo_mini_batch_size=8").to_dict()
    assert checkpoint.config_differences(saved, other) == ["actor_rollout_ref.actor.ppo_mini_batch_size"]
    # 4 prompts x 2 samples a mini-batch, 4 sequences a micro-batch: three workers cannot share them evenly
    with pytest.raises(ConfigError, match=r"must be divisible by .*ppo_micro_batch_size_per_gpu \* world size"):
        _config(workspace, out, "trainer.n_gpus_per_node=3")


def test_dropout_in_the_workers_updates_resumes_exactly(workspace, ray_cluster, tmp_path):
    """Attention dropout in both updates draws from each worker process's own torch generator, which the trainer's
    ``rng_state.pt`` does not hold: the ranks save theirs, so step 2 after a resume from step 1 is step 2 again.
    (Placed before the tests that take ``two``: the cluster's 2 CPUs hold one group at a time.)"""
    dropout = ("+actor_rollout_ref.model.override_config.attention_dropout=0.5",
               "+critic.model.override_config.attention_dropout=0.5")
    out = tmp_path / "out"
    trainer = _trainer(workspace, out, *TWO, *dropout, "trainer.save_freq=1")
    try:
        trainer.fit_step(validate=never)
        first = trainer.fit_step(validate=never).metrics
        trainer.load_checkpoint(out / "global_step_1")
        again = trainer.fit_step(validate=never).metrics
    finally:
        trainer.close()
    for name in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert again[name] == pytest.approx(first[name], rel=1e-6, abs=1e-9), name
    saved = torch.load(out / "global_step_1" / "actor" / "extra_state_rank_1.pt", weights_only=True)
    assert saved["process_rng"]["cpu"].dtype == torch.uint8


# the tests that start a worker group of their own come before the first that takes ``two``, whose group holds
# both of the cluster's CPUs until the module ends (a second group could not be placed)
def test_a_workers_nan_logits_name_the_checkpoint_that_holds_the_weights_that_gave_them(workspace, ray_cluster,
                                                                                       tmp_path):
    from rlhf_core.training.guards import GuardError

    out = tmp_path / "diverged"
    trainer = _trainer(workspace, out, *TWO, "trainer.save_freq=1", "actor_rollout_ref.actor.optim.lr=1e30",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps=-1")  # (DRAWN warms up from 0)
    try:
        trainer.fit_step(validate=never)  # its update takes every weight to about 1e30 (and saves them)
        with pytest.raises(GuardError) as raised:
            trainer.fit_step(validate=never)  # step 2 samples from NaN logits
    finally:
        trainer.close()
    first, *_, last = str(raised.value).split("\n")
    assert first.startswith("training step 2 failed: worker rank ")
    assert "the policy's logits held NaN (or inf)" in str(raised.value)
    assert last == (f"the latest checkpoint {out / 'global_step_1'} holds these weights, so a "
                    "resume from it fails again: no earlier checkpoint is intact: start a new run with a lower "
                    "learning rate (actor_rollout_ref.actor.optim.lr; trainer.resume_mode=disable, or another "
                    "trainer.default_local_dir)")


def test_weights_an_update_on_the_workers_left_non_finite_are_never_saved(workspace, ray_cluster, tmp_path):
    """Each rank checks its own shards before a save: the step's checkpoint is refused, the one before named."""
    from rlhf_core.training.guards import GuardError

    out = tmp_path / "non_finite"
    trainer = _trainer(workspace, out, *TWO, "trainer.save_freq=1", "actor_rollout_ref.actor.optim.lr_warmup_steps=-1")
    try:
        trainer.fit_step(validate=never)
        trainer.actor.scale_lr(float("inf"))  # step 2's update leaves inf or NaN in every rank's shards
        with pytest.raises(GuardError) as raised:
            trainer.fit_step(validate=never)
    finally:
        trainer.close()
    first, second = str(raised.value).split("\n")
    assert first.startswith("saving the checkpoint of step 2 failed: the weights of the actor hold NaN or inf values")
    assert second.startswith(f"the latest checkpoint {out / 'global_step_1'} is intact and from before the divergence")
    assert sorted(path.name for path in out.glob("global_step_*")) == ["global_step_1"]
    assert checkpoint.latest_checkpoint(out) == out / "global_step_1"


def test_two_workers_checkpoint_gathers_into_one_exactly(workspace, two, tmp_path, capsys):
    _, saved = two
    trainer = _trainer(workspace, tmp_path / "gathered")
    trainer.load_checkpoint(saved)
    err = capsys.readouterr().err
    assert f"notice: {saved} was saved by 2 worker(s) and is re-split over 1: the weights, optimizer moments" in err
    assert err.count("re-split") == 1  # one notice for the checkpoint, not one per part
    assert "not continue bit for bit" in err and "own generator" in err
    assert trainer.global_step == 2
    for name in PARTS:
        worker = trainer.workers()[name]
        state = worker.state_dict()
        assert_same(_flat(state["model"], state["optimizer"], _names(worker)), _gathered(saved / name, tmp_path))
        assert_same_extra(state, _extra(saved / name, rank=0))  # the schedule and rank 0's generators
    assert trainer.fit_step(validate=never).step == 3  # and one worker trains on from there


def test_one_workers_checkpoint_resumes_on_two_with_a_notice(workspace, one, two, tmp_path, capsys):
    single, saved = one
    trainer, _ = two
    trainer.load_checkpoint(saved)
    err = capsys.readouterr().err
    assert f"notice: {saved} was saved by 1 worker(s) and is re-split over 2" in err
    assert trainer.global_step == 2
    split = checkpoint.save_checkpoint(trainer, tmp_path / "split")  # the two ranks' state as they loaded it
    seed = trainer.config.trainer.seed
    for name in PARTS:
        assert_same(_gathered(split / name, tmp_path), _whole(saved / name, _names(single.workers()[name])))
        whole = _extra(saved / name)
        assert_same_extra(_extra(split / name, rank=0), whole)  # rank 0 goes on with the saved worker's draws
        rank_1 = _extra(split / name, rank=1)
        assert_same_extra(rank_1, whole, keys=("scheduler", "shuffle_generator"))
        if name == "actor":  # the rank the saved run did not have samples from its own seed, as a fresh run would
            fresh = torch.Generator().manual_seed(seed + ROLLOUT_SEED_STRIDE)  # clear of the shuffle seeds
            assert torch.equal(rank_1["rollout_generator"], fresh.get_state())
    result = trainer.fit_step(validate=never)
    assert result.step == 3 and all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values()
                                    if isinstance(v, float))
    assert "re-split" not in capsys.readouterr().err


def test_a_rollback_takes_the_weights_saved_by_another_number_of_workers(workspace, one, two, tmp_path):
    single, one_saved = one
    trainer, two_saved = two
    step = trainer.global_step
    checkpoint.restore_weights(trainer, one_saved)  # one worker's whole weights onto two workers
    assert trainer.global_step == step
    rolled = checkpoint.save_checkpoint(trainer, tmp_path / "rolled")
    for name in PARTS:
        assert_same(_gathered(rolled / name, tmp_path), _whole(one_saved / name, _names(single.workers()[name])))

    lr = single.actor.optimizer.param_groups[0]["lr"]
    shuffle = single.actor.shuffle_generator.get_state()
    checkpoint.restore_weights(single, two_saved)  # two workers' shards onto one worker
    for name in PARTS:
        worker = single.workers()[name]
        state = worker.state_dict()
        assert_same(_flat(state["model"], state["optimizer"], _names(worker)), _gathered(two_saved / name, tmp_path))
    assert single.actor.optimizer.param_groups[0]["lr"] == lr
    assert torch.equal(single.actor.shuffle_generator.get_state(), shuffle)  # weights only: the streams go on


def test_the_notice_names_what_differs_after_a_resplit(workspace, tmp_path):
    """Greedy, unshuffled, no dynamic sampling: the rounding alone; each of the three settings adds its reason."""
    from types import SimpleNamespace

    def notice(*extra):
        config = _config(workspace, tmp_path / "out", "actor_rollout_ref.actor.shuffle=false", "critic.shuffle=false",
                         *extra)
        trainer = SimpleNamespace(config=config, workers=lambda: {"actor": None})
        return checkpoint.resplit_notice(trainer, tmp_path, 2, 1)

    plain = notice("actor_rollout_ref.rollout.do_sample=false")
    assert plain.endswith("the run does not continue bit for bit as the saved run would have: the sums over the "
                          "workers (gradients, losses) round otherwise")
    assert "own generator" in notice("actor_rollout_ref.rollout.do_sample=true")
    assert "shuffles its own share" in notice("actor_rollout_ref.rollout.do_sample=false",
                                               "actor_rollout_ref.actor.shuffle=true")
    assert "dynamic-sampling round" in notice("actor_rollout_ref.rollout.do_sample=false", "algorithm.adv_estimator=grpo",
                                               "algorithm.filter_groups.enable=true")



def test_a_resume_with_lower_rates_rescales_both_parts_on_every_rank(workspace, one, two, tmp_path, capsys):
    """Lowering the learning rates is the way on after a guard's stop: on a worker group both the actor's and
    the critic's schedules (every rank's) go on at the new rates."""
    single, saved = one
    trainer, _ = two
    optim = {"actor": trainer.config.actor_rollout_ref.actor.optim, "critic": trainer.config.critic.optim}
    old = {name: cfg.lr for name, cfg in optim.items()}
    try:
        for cfg in optim.values():
            cfg.lr /= 2
        trainer.load_checkpoint(saved)
        halved = checkpoint.save_checkpoint(trainer, tmp_path / "halved")
    finally:
        for name, cfg in optim.items():
            cfg.lr = old[name]
    err = capsys.readouterr().err
    for name in PARTS:
        assert f"optim.lr is {old[name] / 2} now, {old[name]} in {saved}" in err
        for rank in (0, 1):
            assert _extra(halved / name, rank=rank)["scheduler"]["base_lrs"] == [pytest.approx(old[name] / 2)]
