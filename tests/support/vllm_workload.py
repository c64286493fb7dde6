"""The real-vLLM tests' workload: a tiny random Llama trained a few steps, published by the CLI, and what
they ask the servers (completions, greedy logprobs, RPCs, the weight checker's checksums)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors.torch import load_file, save_file

from tests.support.helpers import settled

TINY_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
TINY_QWEN3_MOE = {  # the tiny MoE of issue 52's check: vLLM's CPU experts kernel serves it at TP=1 and TP=2
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 128,  # a multiple of 32: no padding in the CPU kernel's packing
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
STEPS = 7
PROMPTS = [[1, *range(10, 40)], [1, *range(500, 520)], [1, 7, 7, 7, 900, 3]]
LONG_PROMPT = [1, *range(100, 228)]  # prefix-cached before an update, asked again after it


def save_tokenizer(out: Path, vocab_size: int = TINY_LLAMA["vocab_size"]) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(out)


def train(root: Path, config: dict[str, Any] = TINY_LLAMA, steps: int = STEPS) -> None:
    """The launch checkpoint (save_pretrained), then checkpoint-<step>/ with every state_dict tensor per step."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.to(torch.bfloat16).save_pretrained(root / "launch")
    save_tokenizer(root / "launch", config["vocab_size"])
    model.float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(1, steps + 1):
        ids = torch.randint(0, config["vocab_size"], (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt = root / "checkpoints" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        state = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
        assert "lm_head.weight" in state
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            (ckpt / name).write_bytes((root / "launch" / name).read_bytes())
        save_file(state, str(ckpt / "model.safetensors"))
        settled(ckpt)


LORA_RANK = 8


def train_lora(root: Path, steps: int = 6, refused_rank: int = 2 * LORA_RANK) -> None:
    """A PEFT LoRA adapter (bf16, every linear layer) on the tiny Llama in root/launch, trained with AdamW.

    Each step's adapter directory (`save_pretrained`: adapter_model.safetensors, adapter_config.json) is
    root/checkpoints/checkpoint-<step>; step `steps + 1` is an adapter of rank `refused_rank`, which a
    server started with `--max-lora-rank LORA_RANK` refuses.
    """
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).to(torch.bfloat16)
    base.save_pretrained(root / "launch")
    save_tokenizer(root / "launch")
    for step, rank in [*((s, LORA_RANK) for s in range(1, steps + 1)), (steps + 1, refused_rank)]:
        if step in (1, steps + 1):
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
            model = get_peft_model(base, config, autocast_adapter_dtype=False)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt = root / "checkpoints" / f"checkpoint-{step}"
        model.save_pretrained(ckpt)
        settled(ckpt)
        if step == steps:
            base = model.unload()  # the base model without this adapter, for the refused one


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pulsesync.cli", *args], capture_output=True, text=True, timeout=300)


async def completion(url: str, prompt: list[int], max_tokens: int = 8, model: str = "tiny") -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        reply = await r.json()
    assert r.status == 200, reply
    logprobs: list[float] = reply["choices"][0]["logprobs"]["token_logprobs"]
    return logprobs


async def greedy_logprobs(url: str, model: str = "tiny") -> list[list[float]]:
    return [await completion(url, p, model=model) for p in [*PROMPTS, LONG_PROMPT]]


async def rpc(url: str, method: str, *args: str) -> dict[str, Any]:
    body = {"method": method, "args": list(args)}
    async with aiohttp.ClientSession() as s, s.post(url + "/collective_rpc", json=body) as r:
        reply = await r.json()
    result: dict[str, Any] = reply["results"][0]
    return result


async def checksums(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as s, s.post(url + "/weight_checker", json={"action": "checksum"}) as r:
        result: dict[str, str] = (await r.json())["checksums"]
    return result


def checkpoint(root: Path, step: int) -> dict[str, torch.Tensor]:
    """The state trained to `step` (as `train` saved it)."""
    return load_file(str(root / "checkpoints" / f"checkpoint-{step}" / "model.safetensors"))


async def weight_info(url: str) -> str:
    """What GET /weight_info names."""
    async with aiohttp.ClientSession() as s, s.get(url + "/weight_info") as r:
        version: str = (await r.json())["weight_version"]
    return version


def publish_checkpoints(root: Path) -> str:
    """A key pair in root/keys, then `pulsesync publish --watch root/checkpoints --once` into root/store; its URL."""
    store_url = f"file://{root / 'store'}"
    assert cli("keygen", "--out", str(root / "keys")).returncode == 0
    publish = cli(
        "publish", "--store", store_url, "--signing-key", str(root / "keys" / "publisher.key"),
        "--anchor-interval", "10", "--watch", str(root / "checkpoints"), "--once",
    )  # fmt: skip
    assert publish.returncode == 0, publish.stderr
    return store_url


def launch_checkpoint(root: Path) -> tuple[Any, Any]:
    """The model and tokenizer; the launch checkpoint (bf16, tokenizer files) in root/launch."""
    import transformers

    from bench.real_llm import smollm2_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir())
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{k: v for k, v in TINY_LLAMA.items() if k != "vocab_size"},
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root / "launch")
    model.float()  # trains in fp32, publishes bf16 (what vLLM serves), as RL trainers do
    tokenizer.save_pretrained(root / "launch")
    return model, tokenizer
