"""The tiny-model figures that docs/memory.md quotes from its tests, measured again and written to results files.

The memory-technique tests assert bounds (NF4 under 0.275x of bf16, fp8 logits within 1.5%, ...); the doc quotes
what those runs measured. This script measures the same quantities the same way (same models, seeds and inputs as
the tests named) and writes one results file per doc section, so that each figure is checked against its own
section's numbers (``scripts/check_figures.py``):

- ``nf4.json``: QLoRA's NF4 block-linear bytes over bf16 and the logits' relative L2 against the unquantized bf16
  model (``tests/mtune/modules/test_nf4.py``);
- ``fp8.json``: fp8 weight storage on the shipped tiny model, e4m3 and e5m2: row scales over codes, logits' relative
  L2 and loss against the unquantized model (fp32 and bf16 compute), greedy agreement on the answer tokens, the
  worst row of a round trip (``tests/mtune/training/memory/test_weight_storage.py``,
  ``tests/mtune/modules/test_fp8_linear.py``);
- ``checkpointing.json``: bytes of distinct storages saved for backward, 8 tiny layers, batch 2 x 64, none / every
  block / every 2nd block (``tests/mtune/training/memory/test_activations.py``); MemTracker's activation bytes at the
  end of forward, 2 layers, none / selective_op / selective_op every 2nd block / block
  (``tests/mtune/training/memory/test_selective_checkpointing.py``); and, with LoRA r8 on q, v, o over a frozen base,
  the activation bytes mtune's TensorTracker (``mtune plan``'s yardstick) counts live at the end of forward;
- ``optimizers.json``: drift from torch.optim.AdamW after 10 steps on a 2 x (128 x 128) MLP and state bytes over
  AdamW's (``tests/mtune/training/memory/test_optimizers.py``).

    python benchmarks/tiny_memory_figures.py [nf4 fp8 checkpointing optimizers]   # ~1 min on 2 CPU cores

Each file records the machine, torch version and date; a table is printed per section.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import mtune
from mtune.models import build_model
from mtune.modules.loss import CrossEntropyLoss

OUT = Path(__file__).resolve().parent / "results" / "tiny_memory_figures"
TINY = Path(mtune.__file__).parent / "assets" / "tiny"


def _relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------------------------ NF4


def nf4() -> list[dict]:
    """The tiny Llama 3.1 (bf16), LoRA r8 on q, v with random B; NF4 vs bf16 bytes of the block linears and logits."""
    from mtune.modules.lora import LoRALinear, apply_lora
    from mtune.modules.lora_state import lora_state_dict
    from mtune.modules.nf4_linear import FrozenNF4Linear, is_nf4

    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    bf16 = build_model("llama3_1", "tiny", device="cpu", dtype=torch.bfloat16)
    qlora = copy.deepcopy(bf16)
    apply_lora(bf16, ["q_proj", "v_proj"], rank=8, alpha=16)
    apply_lora(qlora, ["q_proj", "v_proj"], rank=8, alpha=16, quantize_base=True)
    with torch.no_grad():
        for p in lora_state_dict(bf16).values():
            p.normal_(0, 0.02)
    qlora.load_state_dict(lora_state_dict(bf16), strict=False)

    def nbytes(t):  # an NF4 tensor: its codes, 8-bit block scales, scale-of-scales and lookup table
        if is_nf4(t):
            return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    linears = [m for m in qlora.layers.modules() if isinstance(m, (LoRALinear, FrozenNF4Linear))]
    with torch.no_grad():
        ref, ours = bf16.eval()(tokens).float(), qlora.eval()(tokens).float()
    nf4_bytes = sum(nbytes(m.weight) for m in linears)
    bf16_bytes = sum(m.weight.numel() * 2 for m in linears)
    return [{"name": "NF4 block linears (tiny Llama 3.1, LoRA r8 on q, v)", "nf4_bytes": nf4_bytes,
             "bf16_bytes": bf16_bytes, "nf4_over_bf16_ratio": nf4_bytes / bf16_bytes,
             "logits_relative_l2_error_vs_bf16": _relative_l2(ours, ref)}]


# ------------------------------------------------------------------------------------------------------------ fp8


def fp8() -> list[dict]:
    """The shipped tiny model (pretrained, 4 layers), LoRA r8 on q, v, 16 word-reversal samples; per fp8 format."""
    from mtune.data import instruct_dataset
    from mtune.data.collate import collate_padded
    from mtune.modules.fp8_linear import dequantize_fp8, quantize_fp8
    from mtune.tokenizers import load_tokenizer
    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.model_setup import resolve_model_source, setup_model

    source = resolve_model_source({"checkpoint_dir": str(TINY / "model")})
    tokenizer = load_tokenizer(str(TINY / "model"), max_seq_len=64)
    dataset = instruct_dataset(tokenizer, source=str(TINY / "data" / "train.jsonl"), train_on_input=False)
    batch = collate_padded([dataset[i] for i in range(16)], pad_id=tokenizer.pad_id)
    lora = {"modules": ["q_proj", "v_proj"], "rank": 8, "alpha": 16}

    def run(dtype, **memory):
        model = setup_model(source, device=torch.device("cpu"), dtype=dtype, lora=lora,
                            memory=MemoryConfig(**memory))[0]
        with torch.no_grad():
            logits = model(batch["tokens"]).float()
            loss_sum, n = CrossEntropyLoss()(logits, batch["labels"])
        return model, logits, (loss_sum / n).item()

    answer = batch["labels"] != -100  # labels are already shifted: position i predicts labels[i]
    # a round trip of Gaussian rows 10^4 apart in scale (tests/mtune/modules/test_fp8_linear.py's weight)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64).unsqueeze(1)
    rows = []
    for storage in ("float8_e4m3fn", "float8_e5m2"):
        row = {"name": storage}
        for compute, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            _, ref_logits, ref_loss = run(dtype)
            model, logits, loss = run(dtype, weight_storage_dtype=storage)
            row[f"logits_relative_l2_error_{compute}"] = _relative_l2(logits, ref_logits)
            if compute == "fp32":
                row["unquantized_loss_fp32"], row["loss_fp32"] = ref_loss, loss
                row["loss_change_fraction_fp32"] = (loss - ref_loss) / ref_loss
                same = (logits.argmax(-1) == ref_logits.argmax(-1))[answer]
                row["greedy_agreement_fraction_fp32"] = same.float().mean().item()
                stored = [m for m in model.layers.modules() if hasattr(m, "weight_scale")]
                codes = sum(m.weight.numel() * m.weight.element_size() for m in stored)
                row["scale_share_of_codes"] = sum(m.weight_scale.numel() * 4 for m in stored) / codes
        codes, scale = quantize_fp8(w, getattr(torch, storage))
        back = dequantize_fp8(codes, scale, torch.float32)
        row["round_trip_worst_row_relative_l2_error"] = ((back - w).norm(dim=1) / w.norm(dim=1)).max().item()
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------------------- checkpointing


def checkpointing() -> list[dict]:
    """Saved-for-backward bytes (8 layers) and MemTracker's activation bytes after forward (2 layers)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from mtune.modules.lora import apply_lora
    from mtune.training.planning.tracker import TensorTracker

    from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 512, (2, 64), generator=gen)
    labels = torch.randint(0, 512, (2, 64), generator=gen)

    def model(n_layers):
        torch.manual_seed(0)
        return build_model("llama3_1", "tiny", device="cpu", n_layers=n_layers)

    def saved_bytes(m):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(tokens).sum()
        return sum(size for ptr, size in storages.items() if ptr not in params)

    def after_forward(m):
        tracker = MemTracker()
        tracker.track_external(m)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MemTracker's hooks warn about modules it no longer sees in backward
            with tracker:
                loss_sum, n = CrossEntropyLoss()(m(tokens), labels)
                live = tracker.get_tracker_snapshot("current")
                (loss_sum / n).backward()
        (stats,) = live.values()
        return stats[_MemRefType.ACT]

    plain = model(8)
    none, block, every_2nd = (saved_bytes(plain), saved_bytes(apply_activation_checkpointing(copy.deepcopy(plain))),
                              saved_bytes(apply_activation_checkpointing(copy.deepcopy(plain), every_n_layers=2)))
    rows = [{"name": "saved for backward, 8 layers", "none_bytes": none, "block_bytes": block,
             "every_2nd_block_bytes": every_2nd, "none_over_block_ratio": none / block}]
    def tracked_after_forward(m):  # mtune plan's yardstick: live activation storages once forward and loss ran
        with TensorTracker(model=m) as tracker:
            loss_sum, n = CrossEntropyLoss()(m(tokens), labels)
            live = tracker.current()["device"]["activations"]
            (loss_sum / n).backward()
        return live

    def variants(plain, every_2nd=True):
        out = {"none": plain,
               "selective_op": apply_activation_checkpointing(copy.deepcopy(plain), policy="selective_op"),
               "block": apply_activation_checkpointing(copy.deepcopy(plain), policy="block")}
        if every_2nd:
            out["selective_op_every_2nd_block"] = apply_activation_checkpointing(
                copy.deepcopy(plain), every_n_layers=2, policy="selective_op")
        return out

    plain = model(2)
    row = {"name": "after forward, 2 layers, full (MemTracker)"}
    row.update({f"{k}_bytes": after_forward(m) for k, m in variants(plain).items()})
    row["block_input_bytes"] = plain.embed_tokens(tokens).untyped_storage().nbytes()  # what block keeps a block
    rows.append(row)
    # MemTracker hooks every parameter's gradient, so a frozen base needs mtune's own tracker
    lora = model(2)
    apply_lora(lora, ["q_proj", "v_proj", "o_proj"], rank=8, alpha=16)
    row = {"name": "after forward, 2 layers, LoRA on q, v, o (TensorTracker)"}
    row.update({f"{k}_bytes": tracked_after_forward(m) for k, m in variants(lora, every_2nd=False).items()})
    rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------- optimizers


def optimizers() -> list[dict]:
    """10 steps on a 2 x (128 x 128) MLP: drift from AdamW's parameters, state bytes over AdamW's fp32 state."""
    from mtune.training.optimizers import build_optimizer, optimizer_state_bytes

    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(32, 128, generator=gen), torch.randn(32, 128, generator=gen)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(128, 128, bias=False), nn.Tanh(), nn.Linear(128, 128, bias=False))

    def train(component):
        model = mlp()
        opt = build_optimizer({"_component_": component, "lr": 1e-3, "weight_decay": 0.01}, model)
        for _ in range(10):
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    def drift(model, reference, start):
        diff = sum((p - r).square().sum() for p, r in zip(model.parameters(), reference.parameters())).sqrt()
        moved = sum((r - s).square().sum() for r, s in zip(reference.parameters(), start.parameters())).sqrt()
        return (diff / moved).item()

    reference, ref_opt = train("torch.optim.AdamW")
    rows = []
    for component in ("bitsandbytes.optim.AdamW8bit", "torchao.optim.AdamW8bit", "torchao.optim.AdamWFp8",
                      "torchao.optim.AdamW4bit", "bitsandbytes.optim.PagedAdamW"):
        model, opt = train(component)
        rows.append({"name": component, "drift": drift(model, reference, mlp()),
                     "state_size_ratio": optimizer_state_bytes(opt) / optimizer_state_bytes(ref_opt)})
    return rows


SECTIONS = {"nf4": nf4, "fp8": fp8, "checkpointing": checkpointing, "optimizers": optimizers}


def main(argv: list[str]) -> None:
    names = argv or list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}: choose from {sorted(SECTIONS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "load_average": os.getloadavg()}
    for name in names:
        rows = SECTIONS[name]()
        print(f"\n{name}")
        for row in rows:
            print("  " + row["name"] + ": " + ", ".join(
                f"{k} {v:.6g}" for k, v in row.items() if k != "name"))
        path = OUT / f"{name}.json"
        path.write_text(json.dumps({"command": f"python benchmarks/tiny_memory_figures.py {name}",
                                    "date": datetime.date.today().isoformat(), "machine": machine,
                                    "rows": rows}, indent=1) + "\n")
        print(f"json: {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    main(sys.argv[1:])
