"""`make demo`: the whole path on one machine, on data that ships with every Python install.

1. corpus     the Python standard library's own source files -> corpus.jsonl
2. tokenizer  a byte-level BPE trained on it, and the corpus preprocessed into Megatron's
              .bin/.idx (`hf-megatron preprocess --train-tokenizer bpe`)
3. train      a small Llama-style model from scratch, tensor parallel 2 with sequence
              parallelism, under torchrun (`hf-megatron train`; gloo on CPU, NCCL on GPUs): the
              start banner, a log line every 20 iterations (ms/iteration, TFLOP/s, tokens/s,
              memory, ETA, ...), a validation loss and a text sample at each evaluation,
              TensorBoard events and a loss-curve PNG
4. evaluate   the checkpoint's validation loss and perplexity in one process (`hf-megatron evaluate`:
              the tp=2 checkpoint read in another layout)
5. convert    the Megatron checkpoint -> a Hugging Face folder (`hf-megatron convert megatron-to-hf`)
6. generate   `AutoModelForCausalLM.from_pretrained` on it, and a sample

    python examples/demo.py --out demo_out [--iters 200] [--nproc 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PROMPT = "def __init__(self"


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(cmd: list[str], **kwargs) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def write_corpus(path: Path, max_bytes: int) -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    written = docs = 0
    with path.open("w", encoding="utf-8") as out:
        for file in files:
            text = file.read_text(encoding="utf-8", errors="ignore")
            if not text.strip():
                continue
            out.write(json.dumps({"text": text}) + "\n")
            written, docs = written + len(text), docs + 1
            if written >= max_bytes:
                break
    return docs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2, help="processes = tensor parallel size")
    parser.add_argument("--corpus-mb", type=float, default=3.0)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    started = time.time()

    step("1. corpus: the Python standard library's source")
    docs = write_corpus(out / "corpus.jsonl", int(args.corpus_mb * 1e6))
    print(f"{docs} documents from {sysconfig.get_paths()['stdlib']}")

    step("2. tokenizer + preprocessing into .bin/.idx")
    run([py, "-m", "hf_megatron.cli", "preprocess", "--input", str(out / "corpus.jsonl"),
         "--output-prefix", str(out / "data" / "stdlib"), "--json-keys", "text", "--append-eod",
         "--train-tokenizer", "bpe", "--vocab-size", "2048", "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(out / "tokenizer"), "--workers", "2", "--no-progress"], env=env)

    step("3. train a small Llama from scratch: tensor parallel x sequence parallel")
    from transformers import AutoTokenizer, LlamaConfig
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.save_pretrained(out / "config")
    run([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
         "-m", "hf_megatron.cli", "train", "--hf-config", str(out / "config"),
         "--data-path", str(out / "data" / "stdlib_text_document"), "--split", "98,2,0",
         "--seq-length", "128", "--micro-batch-size", "8", "--global-batch-size", "16",
         "--tensor-model-parallel-size", str(args.nproc), "--sequence-parallel",
         "--train-iters", str(args.iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "10",
         "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
         "--log-interval", "20", "--eval-interval", str(max(args.iters // 4, 1)), "--eval-iters", "4",
         "--save", str(out / "checkpoint"), "--tensorboard-dir", str(out / "tensorboard"),
         "--tokenizer-model", str(out / "tokenizer"), "--sample-prompt", PROMPT, "--sample-tokens", "24"], env=env)
    summary = json.loads((out / "checkpoint" / "training_summary.json").read_text())

    step("4. evaluate the checkpoint on the validation split, in one process")
    # split, seed, sequence length, batch and eval iters come from the checkpoint: the same loss as
    # the run's last validation, here with the tp=2 weights in one process
    run([py, "-m", "hf_megatron.cli", "evaluate", "--load", str(out / "checkpoint"),
         "--data-path", str(out / "data" / "stdlib_text_document"), "--micro-batch-size", "16"], env=env)

    step("5. convert the Megatron checkpoint to a Hugging Face folder")
    run([py, "-m", "hf_megatron.cli", "convert", "megatron-to-hf", "--megatron", str(out / "checkpoint"),
         "--out", str(out / "hf_model"), "--tokenizer", str(out / "tokenizer")], env=env)

    step("6. load with transformers and generate")
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "hf_model")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        sample = model.generate(ids, max_new_tokens=48, do_sample=False)
    print(tokenizer.decode(sample[0]))

    print(f"\n=== done in {time.time() - started:.0f}s: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
          f"over {summary['iterations']} iterations (tp={summary['tp']}, pp={summary['pp']}, dp={summary['dp']}); "
          f"outputs in {out}; loss curve {out / 'tensorboard' / 'loss_curve.png'}; "
          f"TensorBoard: tensorboard --logdir {out / 'tensorboard'}")
    if not summary["final_loss"] < summary["first_loss"]:
        print("the loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
