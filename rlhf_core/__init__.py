"""Offline RLHF: PPO for language models, verl-style, wrapped in a ZenML pipeline."""

import os

# Tensors of 2 MB and more on transparent huge pages: PyTorch's CPU allocator advises the kernel so when
# this is set before its first allocation. Freed activations and gradients of that size go back to the
# kernel, so each new one is faulted in again; in 2 MB pages that costs a quarter of the time it does
# in 4 KB ones (bench/RESULTS.md). A value already in the environment (0 to turn it off) is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
