"""Good inputs the fuzz corpus damages (no tests here), built once per session: tiny HF folders
with a tokenizer, Megatron checkpoints (llama tp2; gpt2 pp2), a torch_dist checkpoint, an indexed
dataset and a JSON-lines corpus."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bad_checkpoints import write_torch_dist
from test_convert_helpers import TEXTS, save_hf

VOCAB = 300  # tiny.VOCAB: the HF models' vocabulary


@dataclass
class Bases:
    root: Path
    llama: Path        # HF folder (model.safetensors, config.json, tokenizer files)
    gpt2: Path
    meg_llama: Path    # Megatron checkpoint of llama, tp2 (release)
    meg_gpt2: Path     # Megatron checkpoint of gpt2, pp2 (release)
    dist: Path         # torch_dist checkpoint of llama (iter_0000009)
    data: str          # indexed dataset prefix (uint16, 12 sequences in 6 documents)
    jsonl: Path

    def copy(self, what: Path, workdir: Path) -> Path:
        out = workdir / Path(what).name
        shutil.copytree(what, out)
        return out

    def copy_data(self, workdir: Path) -> str:
        prefix = str(workdir / "corpus")
        for suffix in (".idx", ".bin"):
            shutil.copy(self.data + suffix, prefix + suffix)
        return prefix


def build_bases(root: Path) -> Bases:
    from hf_megatron.checkpoint.load import open_megatron
    from hf_megatron.conversion.convert import hf_to_megatron
    from hf_megatron.data import IndexedDatasetWriter
    llama, gpt2 = save_hf(root / "llama", "llama"), save_hf(root / "gpt2", "gpt2")
    hf_to_megatron(llama, root / "meg_llama", tp=2)
    hf_to_megatron(gpt2, root / "meg_gpt2", pp=2)
    reader = open_megatron(root / "meg_llama")
    write_torch_dist(reader.full_state_dict(), reader.args, root / "dist", num_layers=2)
    rng = np.random.default_rng(0)
    prefix = str(root / "corpus")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(6):
            writer.add_document(rng.integers(0, VOCAB, 40), [15, 25])
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:8]))
    return Bases(root, llama, gpt2, root / "meg_llama", root / "meg_gpt2", root / "dist", prefix, jsonl)
