"""A trainer process writing HF checkpoints: `python -m tests.support.hf_trainer_proc OUT_DIR STEPS`.

A tiny Qwen2 built with `from_config`, trained in fp32 with AdamW on random tokens; after each
step a bf16 copy is saved with `save_pretrained` into OUT_DIR/checkpoint-<step>/ in several
shards (index written last), as a real trainer would. OUT_DIR/done marks the end.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

TINY_QWEN2 = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def main(out: Path, steps: int) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**TINY_QWEN2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(1, steps + 1):
        ids = torch.randint(0, TINY_QWEN2["vocab_size"], (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out / f"checkpoint-{step}", max_shard_size="100KB")
        time.sleep(0.2)
    (out / "done").touch()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
