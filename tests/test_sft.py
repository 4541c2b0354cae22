"""SFT end to end: `hf-megatron preprocess --sft` (read back by megatron-core's IndexedDataset),
the SFT dataset's windows, and the loss it gives, judged by transformers' own loss with
labels = -100 on the prompt; a poisoned-prompt test shows prompt tokens carry no loss."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data_oracle import IndexedDataset as McoreIndexed
from hf_megatron import cli
from tiny import VOCAB, tiny_hf_model

SEQ = 16


def _records(count, seed=0, poison=None):
    """Prompt/response records whose text is token ids (NullTokenizer --vocab-size VOCAB - 1: megatron-core's
    eod VOCAB - 1 is the tiny model's last id): ids are known exactly."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        prompt = rng.integers(1, VOCAB - 1, int(rng.integers(1, 9))).tolist()
        response = rng.integers(1, VOCAB - 1, int(rng.integers(1, 12))).tolist()
        if poison == "prompt":  # every prompt token but the last (which predicts the first response token)
            prompt = [(t * 7 + 3) % (VOCAB - 2) + 1 for t in prompt[:-1]] + prompt[-1:]
        elif poison == "response":
            response = [(t * 7 + 3) % (VOCAB - 2) + 1 for t in response]
        records.append({"prompt": prompt, "response": response})
    return records


def _write(path, records):
    with open(path, "w") as out:
        for r in records:
            out.write(json.dumps({"prompt": " ".join(map(str, r["prompt"])),
                                  "response": " ".join(map(str, r["response"]))}) + "\n")


def _preprocess(tmp_path, name, records, *extra):
    _write(tmp_path / f"{name}.jsonl", records)
    prefix = str(tmp_path / name)
    assert cli.main(["preprocess", "--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", prefix,
                     "--json-keys", "prompt", "response", "--sft", "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", str(VOCAB - 1), "--append-eod", "--no-progress", *extra]) == 0
    return prefix + "_sft_document"


def _hf_labels(record, eod=VOCAB - 1):
    """transformers' convention: labels = input ids with -100 on the prompt (the model shifts)."""
    ids = record["prompt"] + record["response"] + [eod]
    labels = [-100] * len(record["prompt"]) + record["response"] + [eod]
    return ids[:SEQ + 1], labels[:SEQ + 1]


def _hf_loss(model, windows):
    """Token-weighted mean of transformers' loss over (ids, labels) windows."""
    total = count = 0.0
    with torch.no_grad():
        for ids, labels in windows:
            n = sum(1 for t in labels[1:] if t != -100)
            if n:
                total += model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item() * n
                count += n
    return total / count


def _our_loss(model, dataset):
    """hf_megatron's model and evaluation over every sample of ``dataset`` at once."""
    from hf_megatron.data.loader import batch_iterator
    from hf_megatron.parallel import state
    from hf_megatron.training import TrainingConfig, build_model, evaluate, setup_parallel

    setup_parallel(TrainingConfig())
    try:
        chunks = build_model(model, TrainingConfig())
        batch = next(batch_iterator(dataset, len(dataset)))
        return evaluate(chunks, [batch])
    finally:
        state.reset()


def test_preprocess_cli_writes_tokens_and_mask_megatron_core_reads(tmp_path):
    records = _records(30)
    _write(tmp_path / "sft.jsonl", records)
    prefix = str(tmp_path / "out" / "sft")
    done = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "preprocess", "--input", str(tmp_path / "sft.jsonl"),
                           "--output-prefix", prefix, "--json-keys", "prompt", "response", "--sft",
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--append-eod",
                           "--workers", "2", "--partitions", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tokens, mask = McoreIndexed(prefix + "_sft_document"), McoreIndexed(prefix + "_sft_document_loss_mask")
    assert mask.index.dtype == np.uint8 and tokens.index.dtype == np.uint16
    assert np.array_equal(tokens.document_indices, mask.document_indices)
    assert len(tokens) == len(records)
    for i, r in enumerate(records):
        assert tokens[i].tolist() == r["prompt"] + r["response"] + [VOCAB - 1]
        assert mask[i].tolist() == [0] * len(r["prompt"]) + [1] * (len(r["response"]) + 1)


@pytest.mark.parametrize("pack", [False, True], ids=["pad", "pack"])
def test_sft_loss_equals_transformers_with_prompt_labels_ignored(tmp_path, pack):
    from hf_megatron.data.builder import split_bookends
    from hf_megatron.data.sft import build_sft_datasets

    records = _records(24)
    train, _, _ = build_sft_datasets(_preprocess(tmp_path, "d", records), split_bookends("1"), SEQ, 5, (None,) * 3,
                                     pack)
    model = tiny_hf_model("gpt2").eval()
    windows = []
    for k in range(len(train)):  # the packing plan says which records share a window
        ids, labels = [], []
        for doc in train.document_order[train.window_starts[k]:train.window_starts[k + 1]]:
            doc_ids, doc_labels = _hf_labels(records[int(doc)])
            ids += doc_ids
            labels += [-100] + doc_labels[1:]  # a document's first token is never a target
        windows.append((ids, labels))
    assert sorted(int(d) for d in train.document_order) == list(range(len(records)))
    assert all(len(ids) <= SEQ + 1 for ids, _ in windows)
    assert (len(train) < len(records)) == pack
    ours, reference = _our_loss(model, train), _hf_loss(model, windows)
    assert ours == pytest.approx(reference, rel=1e-5)


def test_poisoned_prompt_tokens_leave_the_loss_unchanged(tmp_path):
    """A model without attention mixing (attention output weights zero) scores token t from
    token t alone, so poisoning every prompt token but the last may change the loss only if
    prompt tokens are scored.  Controls: poisoned responses change it; and the same poisoned
    prompts change the all-tokens (pretraining) loss of the same files."""
    from hf_megatron.data.builder import build_gpt_datasets, split_bookends
    from hf_megatron.data.sft import build_sft_datasets

    model = tiny_hf_model("gpt2").eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()
    losses, pretrain_losses = {}, {}
    for case in ("clean", "prompt", "response"):
        prefix = _preprocess(tmp_path, case, _records(20, poison=None if case == "clean" else case))
        train, _, _ = build_sft_datasets(prefix, split_bookends("1"), SEQ, 5, (None,) * 3, False)
        losses[case] = _our_loss(model, train)
        gpt, _, _ = build_gpt_datasets(prefix, "1", SEQ, 5, cache_dir=None)
        pretrain_losses[case] = _our_loss(model, gpt)
    assert losses["prompt"] == pytest.approx(losses["clean"], rel=1e-6, abs=0)
    assert abs(losses["response"] - losses["clean"]) > 1e-3
    assert abs(pretrain_losses["prompt"] - pretrain_losses["clean"]) > 1e-3


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}"
          "{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the header ends in a space that the first response word absorbs: ' alpha' is one token, half header
SPACED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'Assistant: ' }}{% generation %}"
          "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")


def _chat_tokenizer(path, template):
    """A byte-level BPE with ChatML special tokens (its merges learnt from space-separated words, so
    ' alpha' is one token) and a template whose {% generation %} blocks mark what transformers'
    `return_assistant_tokens_mask` calls assistant tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator([" ".join(WORDS)] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return _chat_tokenizer(tmp_path_factory.mktemp("chat_tok") / "tok", CHATML)


def _chat_preprocess(tmp_path, tokenizer, records):
    with open(tmp_path / "chat.jsonl", "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return cli.main(["preprocess", "--input", str(tmp_path / "chat.jsonl"), "--output-prefix", str(tmp_path / "chat"),
                     "--sft", "--json-keys", "messages", "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", str(tokenizer), "--no-progress"])


@pytest.mark.parametrize("template", ["chatml", "spaced_header"])
def test_chat_messages_mask_equals_transformers_assistant_mask(tmp_path, chat_tokenizer, template):
    """A chat field rendered with the tokenizer's template; transformers' own
    `return_assistant_tokens_mask` (the template's {% generation %} blocks) is the reference --
    also where a token straddles the header and the response."""
    from transformers import AutoTokenizer

    if template == "spaced_header":
        chat_tokenizer = _chat_tokenizer(tmp_path / "tok", SPACED)

    rng = np.random.default_rng(1)
    chats = []
    for i in range(12):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            turns.append({"role": "user", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 6))))})
            turns.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 8))))})
        chats.append(turns)
    assert _chat_preprocess(tmp_path, chat_tokenizer, [{"messages": turns, "id": 1} for turns in chats]) == 0
    prefix = str(tmp_path / "chat")
    tokens, mask = McoreIndexed(prefix + "_sft_document"), McoreIndexed(prefix + "_sft_document_loss_mask")
    reference = AutoTokenizer.from_pretrained(chat_tokenizer)
    for i, turns in enumerate(chats):
        out = reference.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert tokens[i].tolist() == list(out["input_ids"])
        assert mask[i].tolist() == list(out["assistant_masks"])
        assert 0 < sum(out["assistant_masks"]) < len(out["input_ids"])


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "user", "content": "hi"}], "chat.jsonl:2: no assistant message"),
    ("hello", "chat.jsonl:2: expected a non-empty list of chat messages, got str"),
    ([{"role": "user"}], "chat.jsonl:2: message 0 must be an object with 'role' and 'content'"),
    ([{"role": "user", "content": "hi"}, {"role": "gpt", "content": "b"}],  # was 'no assistant message'
     "chat.jsonl:2: message 1 has role 'gpt', expected one of system, developer, user, "
     "assistant, tool, ipython, function (assistant turns are scored)"),
], ids=["no_assistant", "not_a_list", "no_content", "unknown_role"])
def test_bad_chat_records_are_one_line_errors(tmp_path, chat_tokenizer, capsys, messages, needle):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert _chat_preprocess(tmp_path, chat_tokenizer, [good, {"messages": messages}]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("chat_")]  # nothing half-written


def _sft_chunked_argv(path, prefix, tokenizer):
    """preprocess --sft of a chat field, read in several chunks (--workers 2 --partitions 4)."""
    return ["preprocess", "--input", str(path), "--output-prefix", str(prefix), "--sft", "--json-keys", "messages",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--no-progress",
            "--workers", "2", "--partitions", "4"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("bad, needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"text": "hi"}, "no field 'messages'"),
], ids=["chat", "missing_key"])
def test_bad_record_error_names_its_line_past_the_first_chunk(tmp_path, chat_tokenizer, capsys, suffix, bad, needle):
    """`file:line:` with the line an editor shows (blank lines counted; a .gz's line in its decompressed
    text) for a record that is not in the file's first chunk (--workers 2 cuts a .jsonl in 8 by bytes; the
    bad record's chunk holds the blank line before it, which is no record; a .gz is one chunk)."""
    import gzip

    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    lines = [good] * 9 + [""] + [good] * 59 + ["  "] + [json.dumps(bad)] + [good] * 20  # bad on line 71
    text = "\n".join(lines) + "\n"
    path = tmp_path / f"chat{suffix}"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    assert len("\n".join(lines[:70])) > len(text) // 4  # well past the first chunk
    assert cli.main(_sft_chunked_argv(path, tmp_path / "o", chat_tokenizer)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"error: {path}:71: {needle}" in err[-1], err


def test_train_cli_sft_first_loss_and_validation_are_response_only(tmp_path):
    """`hf-megatron train --sft` with lr 0: the first step's loss and the validation loss are
    transformers' response-only losses over the train / valid documents."""
    records = _records(40, seed=3)
    prefix = _preprocess(tmp_path, "run", records)
    model = tiny_hf_model("gpt2")
    model.save_pretrained(tmp_path / "hf")
    done = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "train", "--hf-model", str(tmp_path / "hf"),
                           "--data-path", prefix, "--sft", "--split", "30,10,0", "--seq-length", str(SEQ),
                           "--micro-batch-size", "10", "--global-batch-size", "30", "--train-iters", "1",
                           "--lr", "0", "--eval-interval", "1", "--eval-iters", "1", "--save", str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "ck" / "training_summary.json").read_text())
    model.eval()
    train_ref = _hf_loss(model, [_hf_labels(r) for r in records[:30]])
    assert summary["first_loss"] == pytest.approx(train_ref, rel=1e-5)
    line = next(x for x in done.stdout.splitlines() if "validation loss at iteration 1 " in x)
    valid = float(line.split("| lm loss value: ")[1].split()[0])  # printed as %.6E
    assert valid == pytest.approx(_hf_loss(model, [_hf_labels(r) for r in records[30:]]), rel=1e-5)


@pytest.mark.parametrize("case", ["missing_mask", "three_keys", "pack_without_sft", "empty_valid"])
def test_bad_sft_inputs_are_one_line_errors(tmp_path, capsys, case):
    from hf_megatron.training.config import RunConfig

    prefix = _preprocess(tmp_path, "e", _records(5))
    if case == "missing_mask":
        os.remove(prefix + "_loss_mask.idx")
        from hf_megatron.data.sft import open_sft_prefix
        with pytest.raises(FileNotFoundError, match="e_sft_document_loss_mask.idx: --sft needs the loss mask"):
            open_sft_prefix(prefix)
    elif case == "three_keys":
        argv = ["preprocess", "--input", str(tmp_path / "e.jsonl"), "--output-prefix", str(tmp_path / "x"), "--sft",
                "--json-keys", "prompt", "response", "id", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"]
        assert cli.main(argv) == 2
        assert "--json-keys takes PROMPT RESPONSE or one chat MESSAGES" in capsys.readouterr().err
    elif case == "pack_without_sft":
        with pytest.raises(ValueError, match=r"--sft-pack\): expected --sft"):
            RunConfig(hf_config="c", data_path=[prefix], sft_pack=True)
    else:  # 5 records, split 98,1,1: valid and test get none; fine unless samples are asked of them
        from hf_megatron.data.builder import split_bookends
        from hf_megatron.data.sft import build_sft_datasets
        train, valid, test = build_sft_datasets(prefix, split_bookends("98,1,1"), SEQ, 1, (4, None, None), False)
        assert len(train) == 4 and valid is None and test is None
        with pytest.raises(ValueError, match="e_sft_document.idx: the valid split has no documents"):
            build_sft_datasets(prefix, split_bookends("98,1,1"), SEQ, 1, (4, 2, None), False)


def test_bad_parquet_record_error_names_its_row(tmp_path, chat_tokenizer, capsys):
    """A parquet input is read in row groups: the error names the record's row of the whole file
    (0-based, as datasets and pyarrow index it), not the chunk's row-group number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rows = [good] * 40
    rows[27] = [{"role": "user", "content": "hi"}]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": rows}), path, row_group_size=10)
    assert pq.ParquetFile(path).num_row_groups == 4
    assert cli.main(_sft_chunked_argv(path, tmp_path / "o", chat_tokenizer)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"error: {path}: row 27 (0-based): no assistant message" in err[-1], err
