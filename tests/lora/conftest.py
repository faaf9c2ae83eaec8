"""Without a GPU the Triton LoRA kernels run under Triton's interpreter, which must be
switched on before anything imports triton (peft and transformers do)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
