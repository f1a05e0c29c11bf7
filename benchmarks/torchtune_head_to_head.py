"""mtune against torchtune 0.6.1 on the same work: tokens/s, MFU/HFU, peak RSS and losses, runs interleaved.

Run by hand (never a test). It makes a separate virtual environment for torchtune 0.6.1 (which imports
``torchao.dtypes.nf4tensor``, gone in torchao 0.18, so it gets torchao 0.11.0 over the system torch), writes one
seeded fixture, and runs each configuration in both libraries, alternating which goes first:

    python benchmarks/torchtune_head_to_head.py --setup-venv               # once: /work/venvs/torchtune061 by default
    python benchmarks/torchtune_head_to_head.py                            # every case, 3 runs each, 12 steps
    python benchmarks/torchtune_head_to_head.py --cases lora qlora --reps 2 --steps 6 --compile off
    python benchmarks/torchtune_head_to_head.py --libs mtune mtune:dense_mask torchtune   # + the dense-mask packed path
    python benchmarks/torchtune_head_to_head.py --device cuda                # bf16 on a GPU; peaks from mtune's table

Fixture (``--work``, default /tmp/mtune-h2h): a Llama-3-architecture model in Hugging Face format (dim 512, 8
layers, 8 heads / 2 KV heads, head dim 64, intermediate 1408, vocabulary 8192 with Llama 3's 256 special tokens at
its top, untied: 30.9M parameters, 26.7M of them in matmuls) written by mtune, random weights from seed 0 (mtune's
initialisation); a byte-level BPE tokenizer trained on the fixture's text and written as a tiktoken file plus
tokenizer.json (both libraries read those); 1200 instruction rows. Each run: fp32 on CPU (bf16 too when the CPU has
native bf16), batch 4 x 512 packed tokens, AdamW (lr 1e-4, no weight decay), cosine schedule with 2 warm-up steps,
chunked cross-entropy (8 chunks), seed 0, ``--steps`` optimizer steps, checkpoint saved at the end as each library
does.

Measured per run, in the run's own process: the wall time between consecutive optimizer steps (a global
``register_optimizer_step_post_hook``, the same for both libraries), from which tokens/s = batch x seq_len /
median step time after ``--warmup`` steps (padded positions: both libraries compute them); MFU/HFU = mtune's
FLOPs-per-token count of that configuration x tokens/s / the CPU's fp32 matmul peak, measured here by mtune's fixed
procedure before and after the runs (best kept); peak RSS (``ru_maxrss``); the loss of every step from each
library's own log. Also per configuration, the fixture's own ceiling: one step's matmuls and attention run bare
(the same shapes forward and backward, best of 3), so "% of ceiling" = bare time / step time. The load average is
recorded before every run. Output: JSON, a markdown table and a plot in ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path("/work/venvs/torchtune061")
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1408, vocab_size=8192, tie_word_embeddings=False, rope_theta=500000.0,
             rms_norm_eps=1e-5, max_position_embeddings=2048)
NUM_SPECIAL = 256
SHAPES = {
    "fixture": {},
    # Llama 3.2 3B's blocks (gpu_suite's head-to-head); the fixture's vocabulary and an untied head, as above
    "llama3_2_3B": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                        head_dim=128, intermediate_size=8192),
}
LORA = dict(rank=8, alpha=16, mtune=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            torchtune=["q_proj", "v_proj", "output_proj"])
CASES = {
    "full": dict(lora=False, ac=False, qlora=False),
    "full_ac": dict(lora=False, ac=True, qlora=False),
    "lora": dict(lora=True, ac=False, qlora=False),
    "qlora": dict(lora=True, ac=False, qlora=True),
}


# ------------------------------------------------------------------------------------------------ fixture
def _words(rng: random.Random, n: int) -> list[str]:
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def mtune_model(device=None):
    """The fixture's model in mtune (on meta without ``device``; else with random weights from torch's RNG)."""
    sys.path.insert(0, str(REPO))
    from mtune.models import build_model

    return build_model("llama3_2", "tiny", device=device, dim=SHAPE["hidden_size"], n_layers=SHAPE["num_hidden_layers"],
                       n_heads=SHAPE["num_attention_heads"], n_kv_heads=SHAPE["num_key_value_heads"],
                       head_dim=SHAPE["head_dim"], intermediate_dim=SHAPE["intermediate_size"],
                       vocab_size=SHAPE["vocab_size"], tie_embeddings=SHAPE["tie_word_embeddings"],
                       rope_theta=SHAPE["rope_theta"], norm_eps=SHAPE["rms_norm_eps"],
                       max_seq_len=SHAPE["max_position_embeddings"],
                       rope_scaling=None)  # torchtune's llama3 builder has plain RoPE (no Llama 3.1 scaling)


def llama3_2_special_token_names() -> list[str]:
    """Llama 3.2's 256 special tokens in id order (torchtune 0.6.1's tokenizer asks for its ``<|step_id|>``): mtune's
    generated names, which are Llama 3.1's, but for +5 and the reserved tokens after it, numbered from 2 at +11."""
    sys.path.insert(0, str(REPO))
    from mtune.tokenizers.llama3 import special_tokens

    names = sorted(special_tokens(0), key=special_tokens(0).get)
    return names[:5] + ["<|step_id|>"] + names[6:11] + [f"<|reserved_special_token_{k}|>"
                                                         for k in range(2, 2 + len(names) - 11)]


def write_fixture(work: Path) -> dict:
    """Tokenizer, model and data under ``work`` (reused when present). Returns their paths."""
    model_dir, data = work / "model", work / "train.jsonl"
    paths = {"model": model_dir, "data": data, "tiktoken": model_dir / "original" / "tokenizer.model",
             "tokenizer_json": model_dir / "tokenizer.json"}
    if (model_dir / "model.safetensors").exists() and data.exists():
        return paths
    sys.path.insert(0, str(REPO))
    import torch

    from mtune.tokenizers.bpe_to_tiktoken import train_byte_level_bpe, write_tiktoken_file
    from mtune.tokenizers.llama3 import CHAT_TEMPLATE, PATTERN
    from mtune.training.checkpointing.hf import save_hf_checkpoint

    rng = random.Random(0)
    vocab = _words(rng, 6000)
    rows = []
    for _ in range(1200):
        instruction = " ".join(rng.choice(vocab) for _ in range(rng.randint(12, 30)))
        output = " ".join(rng.choice(vocab) for _ in range(rng.randint(20, 60)))
        rows.append({"instruction": instruction, "input": "", "output": output})
    work.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = SHAPE["vocab_size"] - NUM_SPECIAL
    corpus = [r["instruction"] + "\n" + r["output"] for r in rows] + [" ".join(vocab)]
    spec = json.loads(train_byte_level_bpe(corpus, base, PATTERN))
    torch.manual_seed(0)
    save_hf_checkpoint(mtune_model(device="cpu"), model_dir, max_shard_size="1000GB")  # torchtune reads one file
    write_tiktoken_file(spec, paths["tiktoken"])
    # torchtune 0.6.1's Llama3Tokenizer requires "<|image|>" (Llama 3.2 Vision's): it takes the last reserved slot.
    names = llama3_2_special_token_names()[:-1] + ["<|image|>"]
    spec["added_tokens"] = [{"id": base + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in enumerate(names)]
    paths["tokenizer_json"].write_text(json.dumps(spec))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": CHAT_TEMPLATE}))
    return paths


def fixture_documents(paths: dict, seq: int) -> dict:
    """The fixture's instruct rows as mtune packs them (each row's tokens, the chat template's included):
    ``{"rows", "mean_tokens", "max_tokens", "documents_per_row"}`` for packed rows of ``seq`` tokens."""
    sys.path.insert(0, str(REPO))
    from mtune.data import instruct_dataset
    from mtune.tokenizers import load_tokenizer

    rows = instruct_dataset(load_tokenizer(paths["model"]), str(paths["data"]), packed=False, cache=False,
                            max_seq_len=seq)
    lengths = [len(rows[i]["tokens"]) for i in range(len(rows))]
    mean = statistics.mean(lengths)
    return {"seq": seq, "rows": len(lengths), "mean_tokens": mean, "max_tokens": max(lengths),
            "documents_per_row": seq / mean}


PARITY_STEPS = 4
"""How many times ``--parity`` trains each library on its one batch (an epoch of one step each, AdamW at lr 1e-4
on a cosine schedule without warm-up): the first loss shows both run the same forward, the next ones that both
update the same weights the same way. On the instruct rows each library draws and packs its own batches, so their
loss curves there are not comparable."""


def write_parity_data(paths: dict, batch: int, seq: int) -> Path:
    """``batch`` plain-text rows of exactly ``seq - 1`` tokens each (BOS and EOS included, the fixture's tokenizer;
    torchtune 0.6.1 cuts a text to ``max_seq_len - 1`` tokens) in ``parity_<batch>x<seq>.jsonl`` beside the
    fixture's data. Packed or not, each library's first step then holds every row, one to a packed row, whatever its
    shuffle, and trains every token but the last, so the two first-step losses must agree: the check that both run
    the same work. (The instruct rows cannot show it: torchtune trains the reply's header and each library packs
    its own rows.)"""
    path = paths["data"].with_name(f"parity_{batch}x{seq}.jsonl")
    if path.exists():
        return path
    sys.path.insert(0, str(REPO))
    from mtune.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(paths["model"])
    count = lambda text: len(tokenizer.encode(text, add_bos=True, add_eos=True))  # noqa: E731
    rng, vocab = random.Random(1), _words(random.Random(0), 6000)
    singles = [w for w in vocab if count(w) == 3]  # one token of text
    rows = []
    while len(rows) < batch:
        words: list[str] = []
        while count(" ".join(words)) < seq - 9:
            words.append(rng.choice(vocab))
        while count(" ".join(words)) < seq - 1:
            words.append(rng.choice(singles))
        if count(" ".join(words)) == seq - 1:  # a word that merged with its neighbour overshoots: draw the row again
            rows.append({"text": " ".join(words)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ configs
def mtune_config(paths: dict, case: dict, out: Path, steps: int, compile_: bool, dtype: str, args,
                 kernel: str = "auto", parity: Path | None = None, epochs: int = 1) -> str:
    lora = ""
    if case["lora"]:
        lora = (f"lora:\n  modules: {LORA['mtune']}\n  rank: {LORA['rank']}\n  alpha: {LORA['alpha']}\n"
                f"  quantize_base: {str(case['qlora']).lower()}\nsave_adapter_weights_only: true\n")
    recipe = "lora_single_device" if case["lora"] else "full_single_device"
    return f"""recipe: {recipe}
output_dir: {out}
overwrite_output_dir: true
seed: 0
device: {args.device}
dtype: {dtype}
model:
  checkpoint_dir: {paths['model']}
tokenizer:
  path: {paths['model']}
  max_seq_len: {args.seq}
{lora}dataset:
  _component_: mtune.data.{'text_completion_dataset' if parity else 'instruct_dataset'}
  source: {parity or paths['data']}
  packed: true
  cache: false
task_eval: null
batch_size: {args.batch}
gradient_accumulation_steps: 1
epochs: {epochs}
max_steps_per_epoch: {steps}
clip_grad_norm: null
attention_kernel: {kernel}
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-4
  weight_decay: 0.0
lr_scheduler:
  _component_: mtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: {0 if parity else 2}
loss:
  _component_: mtune.modules.loss.ChunkedCrossEntropyLoss
  num_chunks: 8
enable_activation_checkpointing: {str(case['ac']).lower()}
compile: {str(compile_).lower()}
log_every_n_steps: 1
"""


def torchtune_config(paths: dict, case: dict, out: Path, steps: int, compile_: bool, dtype: str, args,
                     kernel: str = "", parity: Path | None = None, epochs: int = 1) -> str:
    dims = (f"  vocab_size: {SHAPE['vocab_size']}\n  num_layers: {SHAPE['num_hidden_layers']}\n"
            f"  num_heads: {SHAPE['num_attention_heads']}\n  num_kv_heads: {SHAPE['num_key_value_heads']}\n"
            f"  embed_dim: {SHAPE['hidden_size']}\n  max_seq_len: {SHAPE['max_position_embeddings']}\n"
            f"  intermediate_dim: {SHAPE['intermediate_size']}\n  norm_eps: {SHAPE['rms_norm_eps']}\n"
            f"  rope_base: {int(SHAPE['rope_theta'])}\n")
    if case["lora"]:
        model = (f"model:\n  _component_: torchtune.models.llama3.lora_llama3\n"
                 f"  lora_attn_modules: {LORA['torchtune']}\n  apply_lora_to_mlp: true\n"
                 f"  apply_lora_to_output: false\n  lora_rank: {LORA['rank']}\n  lora_alpha: {LORA['alpha']}\n"
                 f"  lora_dropout: 0.0\n  quantize_base: {str(case['qlora']).lower()}\n" + dims)
    else:
        model = "model:\n  _component_: torchtune.models.llama3.llama3\n" + dims
    return f"""output_dir: {out}
{model}tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {paths['tiktoken']}
  special_tokens_path: {paths['tokenizer_json']}
  max_seq_len: {args.seq}
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {paths['model']}
  checkpoint_files: [model.safetensors]
  recipe_checkpoint: null
  output_dir: {out}
  model_type: LLAMA3
resume_from_checkpoint: false
save_adapter_weights_only: true
dataset:
{_torchtune_dataset(paths, parity)}
seed: 0
shuffle: true
batch_size: {args.batch}
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-4
  weight_decay: 0.0
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: {0 if parity else 2}
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
  num_output_chunks: 8
epochs: {epochs}
max_steps_per_epoch: {steps}
gradient_accumulation_steps: 1
clip_grad_norm: null
optimizer_in_bwd: false
compile: {str(compile_).lower()}
device: {args.device}
dtype: {dtype}
enable_activation_checkpointing: {str(case['ac']).lower()}
enable_activation_offloading: false
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: {out}/logs
log_every_n_steps: 1
log_peak_memory_stats: false
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: false
"""


def _torchtune_dataset(paths: dict, parity: Path | None) -> str:
    if parity:  # whole rows (split_across_pack would cut one into two documents)
        return (f"  _component_: torchtune.datasets.text_completion_dataset\n  source: json\n  data_files: {parity}\n"
                "  column: text\n  packed: true\n  split_across_pack: false\n  split: train")
    return (f"  _component_: torchtune.datasets.instruct_dataset\n  source: json\n  data_files: {paths['data']}\n"
            "  column_map: {input: instruction, output: output}\n  packed: true\n  split: train")


# ------------------------------------------------------------------------------------------------ worker
def worker(lib: str, config: str, recipe: str, result: str) -> None:
    """Runs one recipe in this process, timing optimizer steps; writes ``result`` JSON."""
    import resource

    import torch

    stamps: list[float] = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cuda = torch.cuda.is_available()
    peaks = [0, 0]  # the allocator's allocated and reserved peaks, read at every step
    # with H2H_PROFILE_STEP=k, the step after the k-th optimizer step is profiled, the same way in both libraries
    profile_after = int(os.environ.get("H2H_PROFILE_STEP", 0))
    profiled: dict = {}

    def stamp(*_):
        if cuda:
            torch.cuda.synchronize()
            # a library may reset the peaks between steps (mtune does at every log line): the run's peak is the
            # largest of the per-step peaks, read the same way for both libraries
            peaks[0] = max(peaks[0], torch.cuda.max_memory_allocated())
            peaks[1] = max(peaks[1], torch.cuda.max_memory_reserved())
        stamps.append(time.perf_counter())
        if profile_after and len(stamps) == profile_after:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            profiled["profiler"] = profile(activities=activities)
            profiled["profiler"].__enter__()
        elif profile_after and len(stamps) == profile_after + 1:
            from gpu_suite import profile_top  # beside this script: the suite's reading of a profile

            profiled["profiler"].__exit__(None, None, None)
            # by op only: no Python stacks recorded, and mtune's functions say nothing of torchtune's step
            profiled.update(profile_top(profiled.pop("profiler"), cuda, sites=False))

    register_optimizer_step_post_hook(stamp)
    start = time.perf_counter()
    if lib == "mtune":
        from mtune._cli.main import main

        rc = main(["run", recipe, "--config", config])
        if rc:
            raise SystemExit(rc)
    else:
        import runpy

        import torchtune

        script = Path(torchtune.__file__).parents[1] / "recipes" / f"{recipe}.py"
        sys.argv = [str(script), "--config", config]
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as done:  # the recipe ends with sys.exit(recipe_main())
            if done.code:
                raise
    Path(result).write_text(json.dumps({
        "start": start, "stamps": stamps, "end": time.perf_counter(),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
        "cuda_max_allocated_bytes": max(peaks[0], torch.cuda.max_memory_allocated()) if cuda else None,
        "cuda_max_reserved_bytes": max(peaks[1], torch.cuda.max_memory_reserved()) if cuda else None,
        **profiled,
    }))


def _losses(lib: str, out: Path) -> list[float]:
    if lib == "mtune":
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [r["loss"] for r in rows if "loss" in r]
    text = "".join(p.read_text() for p in sorted((out / "logs").glob("*.txt")))
    return [float(m) for m in re.findall(r"Step \d+ \| loss:([0-9.eE+-]+)", text)]


def run_one(lib: str, paths: dict, case_name: str, compile_: bool, dtype: str, args, rep: int,
            parity: Path | None = None) -> dict:
    """One run of ``lib`` (``args.steps`` steps), or with ``parity`` (:func:`write_parity_data`) its one step on
    those rows, :data:`PARITY_STEPS` times."""
    case = CASES[case_name]
    steps_asked = 1 if parity else args.steps  # parity: PARITY_STEPS epochs of its one step
    tag = (f"{lib.replace(':', '-')}_{case_name}_{dtype}_{'compile' if compile_ else 'eager'}_"
           f"{'parity' if parity else rep}")
    out = args.work / "runs" / tag
    shutil.rmtree(out, ignore_errors=True)  # torchtune adds a log file per run: an earlier run's would be read first
    out.mkdir(parents=True)
    config = out.with_suffix(".yaml")
    lib_name = lib
    lib, _, kernel = lib.partition(":")  # "mtune:dense_mask": mtune with that attention_kernel
    make = mtune_config if lib == "mtune" else torchtune_config
    config.write_text(make(paths, case, out, steps_asked, compile_, dtype, args, kernel or "auto", parity,
                           PARITY_STEPS if parity else 1))
    if lib == "mtune":
        python, recipe = sys.executable, "lora_single_device" if case["lora"] else "full_single_device"
        # mfu in mtune's own log against the peak this benchmark measured (not a cache taken under other load)
        # mtune first, then whatever the caller's PYTHONPATH holds (the GPU machine's carried omegaconf/torchao)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "MTUNE_PEAK_FLOPS": str(args.peaks[dtype])}
    else:
        python = args.torchtune_python or str(args.venv / "bin" / "python")
        recipe = "lora_finetune_single_device" if case["lora"] else "full_finetune_single_device"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if args.torchtune_path:  # e.g. the GPU machine's wheels: torchtune + torchao 0.11 before mtune's site
            env["PYTHONPATH"] = args.torchtune_path
    if args.profile and not parity:  # the last step, profiled: past the warm-up and mtune's tracked first steps
        env["H2H_PROFILE_STEP"] = str(args.steps - 1)
    result = out.with_suffix(".json")
    load = os.getloadavg()
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--worker", lib, str(config), recipe, str(result)],
                          env=env, cwd=str(args.work), capture_output=True, text=True)
    (out.with_suffix(".log")).write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"lib": lib_name, "case": case_name, "compile": compile_, "dtype": dtype, "rep": rep, "error":
                (proc.stdout + proc.stderr)[-2000:], "loadavg": load}
    if not result.exists():
        return {"lib": lib_name, "case": case_name, "compile": compile_, "dtype": dtype, "rep": rep,
                "error": "no result written: " + (proc.stdout + proc.stderr)[-1800:], "loadavg": load}
    raw = json.loads(result.read_text())
    if parity:
        return {"lib": lib_name, "case": case_name, "dtype": dtype, "losses": _losses(lib, out)}
    # The run's own optimizer steps only: mtune's end-of-run plan check steps the planner's copy of the optimizer on
    # fake tensors, which fires the same global hook (two stamps 0.4-1 s apart that are not training steps).
    stamps = raw["stamps"][:args.steps]
    steps = [b - a for a, b in zip(stamps, stamps[1:])]  # step k+1's time, k >= 1
    timed = steps[max(args.warmup - 1, 0):]
    step_s = statistics.median(timed)
    return {"lib": lib_name, "case": case_name, "compile": compile_, "dtype": dtype, "rep": rep, "loadavg": load,
            "step_times_s": steps, "median_step_s": step_s,
            "tokens_per_second": args.batch * args.seq / step_s, "max_rss_gib": raw["max_rss_bytes"] / 2**30,
            "cuda_max_allocated_gib": (raw["cuda_max_allocated_bytes"] or 0) / 2**30,
            "cuda_max_reserved_gib": (raw.get("cuda_max_reserved_bytes") or 0) / 2**30,
            "losses": _losses(lib, out), "threads": raw["threads"], "wall_s": raw["end"] - raw["start"],
            **{k: v for k, v in raw.items() if k.startswith("profile_top")}}


def first_step_parity(paths: dict, dtype: str, args) -> dict:
    """Both libraries' LoRA losses on :func:`write_parity_data`'s rows, trained :data:`PARITY_STEPS` times (eager,
    ``args.batch`` x ``args.seq``): ``{"dtype", "mtune", "torchtune", "relative_difference", "mtune_losses",
    "torchtune_losses", "max_relative_difference"}``, the first three of the first step, the last over every step
    (a library that failed: its error in place of its losses)."""
    data = write_parity_data(paths, args.batch, args.seq)
    record: dict = {"dtype": dtype}
    for lib in ("mtune", "torchtune"):
        run = run_one(lib, paths, "lora", False, dtype, args, 0, parity=data)
        losses = run.get("losses")
        record[lib] = losses[0] if losses else {"error": run.get("error", "no loss logged")[-300:]}
        if losses:
            record[f"{lib}_losses"] = losses
    if all(isinstance(record[lib], float) for lib in ("mtune", "torchtune")):
        record["relative_difference"] = abs(record["mtune"] - record["torchtune"]) / record["torchtune"]
        pairs = list(zip(record["mtune_losses"], record["torchtune_losses"]))
        record["max_relative_difference"] = max(abs(a - b) / b for a, b in pairs) if pairs else None
    print(f"[parity] {dtype}: losses mtune {record.get('mtune_losses', record['mtune'])} / torchtune "
          f"{record.get('torchtune_losses', record['torchtune'])}", flush=True)
    return record


# ------------------------------------------------------------------------------------------------ ceiling
def _meta_model(case: dict):
    sys.path.insert(0, str(REPO))
    from mtune.modules.lora import apply_lora
    from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing

    model = mtune_model()
    if case["lora"]:
        apply_lora(model, LORA["mtune"], rank=LORA["rank"], alpha=LORA["alpha"], quantize_base=case["qlora"])
    if case["ac"]:
        apply_activation_checkpointing(model)
    return model


def flops(case: dict, seq_len: int = 512):
    from mtune.modules.loss import ChunkedCrossEntropyLoss
    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.observe.flops import flops_per_token

    model = _meta_model(case)
    return flops_per_token(model, seq_len, MemoryConfig(enable_activation_checkpointing=bool(case["ac"])),
                           loss_recomputes_projection=ChunkedCrossEntropyLoss.recomputes_projection(model.lm_head))


def ceiling(case: dict, dtype_name: str = "fp32", batch: int = 4, seq_len: int = 512, repeats: int = 3,
            device: str = "cpu") -> dict:
    """Seconds of one step's matmuls and attention run bare: ``model`` (forward + backward as the run needs them)
    and ``hardware`` (plus the forward work recomputed). Linears by shape, each timed forward and backward."""
    import torch
    import torch.nn.functional as F

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    tokens = batch * seq_len

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return min(times)

    def randn(*shape, requires_grad=False):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)

    def linear_times(fin, fout, x_grad, w_grad):
        x, w, g = randn(tokens, fin, requires_grad=x_grad), randn(fout, fin, requires_grad=w_grad), randn(tokens, fout)
        fwd = best(lambda: F.linear(x, w))
        need = [t for t in (x, w) if t.requires_grad]
        both = best(lambda: torch.autograd.grad(F.linear(x, w), need, g)) if need else fwd
        return fwd, both - fwd

    heads, kv, hd = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    q = randn(batch, heads, seq_len, hd, requires_grad=True)
    k, v = randn(batch, kv, seq_len, hd, requires_grad=True), randn(batch, kv, seq_len, hd, requires_grad=True)
    docs = torch.arange(seq_len, device=device) // 100  # packed documents of ~100 tokens: a block-causal mask
    idx = torch.arange(seq_len, device=device)
    mask = ((idx[None, :] <= idx[:, None]) & (docs[None, :] == docs[:, None]))[None, None].expand(batch, 1, -1, -1)
    go = randn(batch, heads, seq_len, hd)
    attn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    attn_fwd = best(attn)
    attn_bwd = best(lambda: torch.autograd.grad(attn(), (q, k, v), go)) - attn_fwd

    model = _meta_model(case)
    from mtune.modules.lora import LoRALinear

    block = model.layers[0]
    fwd = bwd = last = 0.0
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        module = block.get_submodule(("self_attn." if name[0] in "qkvo" else "mlp.") + name)
        f, b = linear_times(module.in_features, module.out_features, True, not case["lora"])
        fwd, bwd, last = fwd + f, bwd + b, f
        if isinstance(module, LoRALinear):
            fa, ba = linear_times(module.in_features, LORA["rank"], True, True)
            fb, bb = linear_times(LORA["rank"], module.out_features, True, True)
            fwd, bwd, last = fwd + fa + fb, bwd + ba + bb, fb
        if name == "v_proj":
            fwd, bwd = fwd + attn_fwd, bwd + attn_bwd
    layers = SHAPE["num_hidden_layers"]
    head_f, head_b = linear_times(SHAPE["hidden_size"], SHAPE["vocab_size"], True, not case["lora"])
    model_s = layers * (fwd + bwd) + head_f + head_b
    recompute = head_f + (layers * (fwd - last) if case["ac"] else 0.0)
    return {"model_s": model_s, "hardware_s": model_s + recompute}


# ------------------------------------------------------------------------------------------------ report
def summarize(results: list[dict], meta: dict) -> tuple[list[dict], str]:
    rows, groups = [], {}
    for r in results:
        groups.setdefault((r["case"], r["dtype"], r["compile"]), {}).setdefault(r["lib"], []).append(r)
    for (case, dtype, compile_), libs in groups.items():
        peak = meta["peak_flops"][dtype]
        fpt = meta["flops"][case]
        row = {"case": case, "dtype": dtype, "compile": compile_}
        for lib, runs in libs.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                row[lib] = {"error": runs[0]["error"][-300:]}
                continue
            tps = statistics.median(r["tokens_per_second"] for r in ok)
            step_s = statistics.median(r["median_step_s"] for r in ok)
            ceil = meta["ceiling"].get(f"{case}_{dtype}")
            row[lib] = {
                "runs": len(ok), "tokens_per_second": tps,
                "mfu": fpt["model"] * tps / peak, "hfu": fpt["hardware"] * tps / peak,
                "of_ceiling": (ceil["hardware_s" if CASES[case]["ac"] else "model_s"] / step_s) if ceil else None,
                "max_rss_gib": statistics.median(r["max_rss_gib"] for r in ok),
                "final_loss": statistics.median(r["losses"][-1] for r in ok if r["losses"]) if any(
                    r["losses"] for r in ok) else None,
                "first_loss": ok[0]["losses"][0] if ok[0]["losses"] else None,
            }
        if "tokens_per_second" in row.get("mtune", {}) and "tokens_per_second" in row.get("torchtune", {}):
            row["speedup"] = row["mtune"]["tokens_per_second"] / row["torchtune"]["tokens_per_second"]
            row["rss_ratio"] = row["mtune"]["max_rss_gib"] / row["torchtune"]["max_rss_gib"]
        rows.append(row)

    def cell(row, lib, key, fmt):
        value = row.get(lib, {}).get(key)
        return "err" if "error" in row.get(lib, {}) else ("–" if value is None else fmt.format(value))

    lines = ["| case | dtype | compile | mtune tok/s | torchtune tok/s | × | mtune MFU / HFU | torchtune MFU | "
             "mtune % of ceiling | mtune RSS GiB | torchtune RSS GiB | RSS × | loss first → final (mtune / torchtune) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        loss = (f"{cell(row, 'mtune', 'first_loss', '{:.3f}')} → {cell(row, 'mtune', 'final_loss', '{:.3f}')} / "
                f"{cell(row, 'torchtune', 'first_loss', '{:.3f}')} → {cell(row, 'torchtune', 'final_loss', '{:.3f}')}")
        lines.append(
            f"| {row['case']} | {row['dtype']} | {'on' if row['compile'] else 'off'} | "
            f"{cell(row, 'mtune', 'tokens_per_second', '{:.0f}')} | {cell(row, 'torchtune', 'tokens_per_second', '{:.0f}')} | "
            f"{row.get('speedup', 0):.2f} | {cell(row, 'mtune', 'mfu', '{:.1%}')} / {cell(row, 'mtune', 'hfu', '{:.1%}')} | "
            f"{cell(row, 'torchtune', 'mfu', '{:.1%}')} | {cell(row, 'mtune', 'of_ceiling', '{:.0%}')} | "
            f"{cell(row, 'mtune', 'max_rss_gib', '{:.2f}')} | {cell(row, 'torchtune', 'max_rss_gib', '{:.2f}')} | "
            f"{row.get('rss_ratio', 0):.2f} | {loss} |")
    variants = sorted({lib for row in rows for lib in row if lib.startswith("mtune:")})
    if variants:  # mtune with another attention_kernel, run in the same interleaving: the default against it
        lines += ["", "| case | dtype | compile | mtune tok/s | " + " | ".join(
            f"{v} tok/s | mtune ÷ {v} | {v} RSS GiB" for v in variants) + " |",
                  "|---|---|---|---:|" + "---:|---:|---:|" * len(variants)]
        for row in rows:
            cells = []
            for v in variants:
                mine, theirs = row.get("mtune", {}).get("tokens_per_second"), row.get(v, {}).get("tokens_per_second")
                ratio = f"{mine / theirs:.2f}" if mine and theirs else "–"
                cells.append(f"{cell(row, v, 'tokens_per_second', '{:.0f}')} | {ratio} | "
                             f"{cell(row, v, 'max_rss_gib', '{:.2f}')}")
            lines.append(f"| {row['case']} | {row['dtype']} | {'on' if row['compile'] else 'off'} | "
                         f"{cell(row, 'mtune', 'tokens_per_second', '{:.0f}')} | " + " | ".join(cells) + " |")
    return rows, "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\n{r['dtype']} {'compiled' if r['compile'] else 'eager'}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    for ax, key, title in ((axes[0], "tokens_per_second", "tokens/s (higher is better)"),
                           (axes[1], "max_rss_gib", "peak RSS GiB (lower is better)")):
        for i, lib in enumerate(("mtune", "torchtune")):
            values = [r.get(lib, {}).get(key) or 0 for r in rows]
            ax.bar([x + 0.4 * i for x in range(len(rows))], values, width=0.4, label=lib)
        ax.set_xticks([x + 0.2 for x in range(len(rows))], labels, fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_facts() -> dict:
    sys.path.insert(0, str(REPO))
    from mtune.training.observe.peak_flops import _cpu_flags, cpu_has_native_bf16, cpu_model_name

    flags = _cpu_flags()
    return {"cpu": cpu_model_name(), "cpus": os.cpu_count(), "native_bf16": cpu_has_native_bf16(),
            "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")) or f == "bf16")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=4, metavar=("LIB", "CONFIG", "RECIPE", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--setup-venv", action="store_true", help="create the torchtune 0.6.1 venv and exit")
    parser.add_argument("--fixture-documents", action="store_true",
                        help="write the fixture's document lengths as mtune packs them at --seq "
                             "(torchtune_head_to_head_fixture.json in --out) and exit")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--work", type=Path, default=Path("/tmp/mtune-h2h"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--compile", choices=["off", "on", "both"], default="both")
    parser.add_argument("--dtypes", nargs="+", default=None, help="default fp32, plus bf16 on a CPU with native bf16")
    parser.add_argument("--libs", nargs="+", default=["mtune", "torchtune"],
                        help="mtune, torchtune, or mtune:KERNEL (mtune with attention_kernel=KERNEL, e.g. "
                             "mtune:dense_mask, the packed path before segments; reported in a second table)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median (compile, first touch)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shape", choices=list(SHAPES), default="fixture",
                        help="the model's blocks (the fixture's vocabulary in every shape)")
    parser.add_argument("--no-ceiling", action="store_true", help="skip timing the bare matmul/attention ceiling")
    parser.add_argument("--torchtune-python", default=None, help="a python with torchtune 0.6.1 (instead of --venv)")
    parser.add_argument("--torchtune-path", default=None, help="PYTHONPATH for torchtune's runs")
    parser.add_argument("--profile", action="store_true",
                        help="profile each run's last step, the same way in both libraries: the costliest ops by "
                             "their own time, in each run's profile_top_cpu / profile_top_device")
    parser.add_argument("--parity", action="store_true",
                        help="first, each library's LoRA step on rows both see whole (write_parity_data), eager, per "
                             f"dtype, taken {PARITY_STEPS} times: their losses, in the JSON's 'parity'")
    args = parser.parse_args()
    SHAPE.update(SHAPES[args.shape])
    if args.shape != "fixture":
        args.work = args.work / args.shape  # write_fixture reuses what it finds: one fixture per shape
    if args.worker:
        worker(*args.worker)
        return
    if args.fixture_documents:
        args.out.mkdir(parents=True, exist_ok=True)
        stats = fixture_documents(write_fixture(args.work), args.seq)
        (args.out / "torchtune_head_to_head_fixture.json").write_text(json.dumps(stats, indent=1) + "\n")
        print(stats)
        return
    if args.setup_venv:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(args.venv)], check=True)
        subprocess.run([str(args.venv / "bin" / "pip"), "install", "torchtune==0.6.1", "torchao==0.11.0"], check=True)
        return
    import torch

    sys.path.insert(0, str(REPO))
    from mtune.training.observe.peak_flops import measure_cpu_matmul_flops

    facts = cpu_facts()
    if args.device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
    default_dtypes = ["bf16"] if args.device == "cuda" else (["fp32", "bf16"] if facts["native_bf16"] else ["fp32"])
    dtypes = args.dtypes or default_dtypes
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    paths = write_fixture(args.work)

    def measure_peaks():
        if args.device == "cuda":
            from mtune.training.observe.peak_flops import peak_flops

            return {d: peak_flops("cuda", d).flops for d in dtypes}
        return {d: measure_cpu_matmul_flops({"fp32": torch.float32, "bf16": torch.bfloat16}[d]) for d in dtypes}

    peaks = [measure_peaks()]
    args.peaks = peaks[0]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **facts,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
            "warmup": args.warmup, "reps": args.reps, "device": args.device, "batch": args.batch, "seq": args.seq,
            "shape": args.shape,
            "flops": {}, "ceiling": {}, "loadavg_start": os.getloadavg()}
    for name in args.cases:
        f = flops(CASES[name], args.seq)
        meta["flops"][name] = {"model": f.model, "hardware": f.hardware}
        for dtype in dtypes:
            if not args.no_ceiling:
                meta["ceiling"][f"{name}_{dtype}"] = ceiling(CASES[name], dtype, args.batch, args.seq,
                                                             device=args.device)
    parity = [first_step_parity(paths, dtype, args) for dtype in dtypes] if args.parity else []
    results = []
    for rep in range(args.reps):
        for name in args.cases:
            for dtype in dtypes:
                for compile_ in compiles:
                    order = args.libs if rep % 2 == 0 else args.libs[::-1]
                    for lib in order:
                        r = run_one(lib, paths, name, compile_, dtype, args, rep)
                        results.append(r)
                        status = r.get("error", "")[-200:] or (f"{r['tokens_per_second']:.0f} tok/s, "
                                                               f"rss {r['max_rss_gib']:.2f} GiB")
                        print(f"[rep {rep}] {lib:9s} {name:8s} {dtype} compile={compile_}: {status} "
                              f"(load {r['loadavg'][0]:.1f})", flush=True)
    peaks.append(measure_peaks())
    meta["peak_flops_measurements"] = peaks
    meta["peak_flops"] = {d: max(p[d] for p in peaks) for d in dtypes}
    meta["loadavg_end"] = os.getloadavg()
    rows, table = summarize(results, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torchtune_head_to_head.json").write_text(json.dumps(
        {"meta": meta, "summary": rows, "runs": results, "parity": parity}, indent=1, default=str) + "\n")
    (args.out / "torchtune_head_to_head.md").write_text(table + "\n")
    plot(rows, args.out / "torchtune_head_to_head.png")
    print(table)


if __name__ == "__main__":
    main()
