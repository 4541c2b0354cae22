"""Peak memory of the streaming converters on a synthetic ~1B Llama-style model (CPU).

    .venv/bin/python bench/bench_convert.py --workdir /tmp/bench_convert [--layers 18]

Writes a random bf16 model as a sharded save_pretrained folder (streamed, never whole in
memory), then runs each conversion in a fresh process and reports its peak RSS (VmHWM, includes
file pages touched through mmap) and its peak anonymous memory (RssAnon, sampled every 20 ms:
what the process really allocated).  Anchor, in the same run: transformers
`from_pretrained` + `save_pretrained` of the same folder.  Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8,
             vocab_size=32000, max_position_embeddings=2048)

# runs in the child: sample RssAnon while `work` runs, then report peaks as JSON
CHILD = r"""
import json, sys, threading, time
peak = [0]
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
def sample():
    while True:
        peak[0] = max(peak[0], rss("RssAnon:"))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
start = time.time()
exec(sys.argv[1])
peak[0] = max(peak[0], rss("RssAnon:"))
print("RESULT" + json.dumps({"seconds": time.time() - start, "vmhwm": rss("VmHWM:"), "anon": peak[0]}))
"""


def make_model(folder: Path, layers: int) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    config = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **SHAPE)
    folder.mkdir(parents=True)
    h, f = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = SHAPE["num_key_value_heads"] * h // SHAPE["num_attention_heads"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    shards, weight_map, largest, total = [], {}, 0, 0

    def flush(tensors):
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update({k: name for k in tensors})

    flush({"model.embed_tokens.weight": rand(SHAPE["vocab_size"], h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        flush({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
               p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
               p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
               p + "mlp.down_proj.weight": rand(h, f)})
    flush({"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": rand(SHAPE["vocab_size"], h)})
    for name in shards:  # rename to the save_pretrained pattern now that the count is known
        final = name.replace(".safetensors", f"-of-{len(shards):05d}.safetensors")
        (folder / name).rename(folder / final)
        weight_map = {k: (final if v == name else v) for k, v in weight_map.items()}
    from safetensors import safe_open
    for name in set(weight_map.values()):
        with safe_open(str(folder / name), framework="pt") as fh:
            for key in fh.keys():
                shape = fh.get_slice(key).get_shape()
                numel = 1
                for d in shape:
                    numel *= d
                largest, total = max(largest, numel * 2), total + numel * 2
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    return {"params": total // 2, "bytes": total, "largest": largest}


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))[6:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="/tmp/bench_convert")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--shard-size", default="500MB", help="megatron-to-hf output shard size")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    sizes = make_model(work / "hf", args.layers)
    gib = 1024 ** 3
    print(f"model: {sizes['params'] / 1e9:.2f}B params, {sizes['bytes'] / gib:.2f} GiB bf16, "
          f"largest tensor {sizes['largest'] / gib:.3f} GiB, megatron-to-hf shard size {args.shard_size}")
    conv = "from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf, reshard; "
    steps = [
        ("transformers from_pretrained + save_pretrained (anchor)",
         "from transformers import AutoModelForCausalLM; import torch; "
         f"m = AutoModelForCausalLM.from_pretrained('{work}/hf', dtype=torch.bfloat16); "
         f"m.save_pretrained('{work}/anchor', max_shard_size='{args.shard_size}')"),
        ("hf-to-megatron tp2 pp2", conv + f"hf_to_megatron('{work}/hf', '{work}/m22', 2, 2)"),
        ("reshard (2,2) -> (1,1)", conv + f"reshard('{work}/m22', '{work}/m11', 1, 1)"),
        ("megatron-to-hf from tp2 pp2", conv + f"megatron_to_hf('{work}/m22', '{work}/back', max_shard_size='{args.shard_size}')"),
    ]
    print("| step | seconds | peak RSS (VmHWM) GiB | peak anonymous GiB | anonymous / model size |")
    print("| --- | --- | --- | --- | --- |")
    for label, code in steps:
        result = run(code)
        print(f"| {label} | {result['seconds']:.1f} | {result['vmhwm'] / gib:.2f} | {result['anon'] / gib:.2f} | "
              f"{result['anon'] / sizes['bytes']:.2f} |", flush=True)
    same = run("import sys; sys.path.insert(0, 'tests'); from test_convert_helpers import hf_tensors, assert_identical; "
               f"assert_identical(hf_tensors('{work}/hf'), hf_tensors('{work}/back'))")
    print(f"round trip bit-identical: yes ({same['seconds']:.0f} s to check)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
