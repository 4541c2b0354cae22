"""The run's tokenizer travels with its checkpoints: `<save>/tokenizer/`, named in `args`.

Where it comes from, first match: none with `--tokenizer-type NullTokenizer`; GPT-2's BPE written as
a transformers folder from `--vocab-file` / `--merge-file` (`--tokenizer-type GPT2BPETokenizer`);
`--tokenizer-model` (an HF tokenizer folder, or a SentencePiece `.model` file: stored as
`tokenizer.model` beside `megatron_tokenizer.json`, which keeps its Megatron-LM kind), the `--hf-model` /
`--hf-config` folder, the `tokenizer/` folder of `--pretrained-checkpoint` or `--load` (a Megatron
folder we or a converter wrote).  `hf-megatron convert megatron-to-hf` and `reshard` take
`<megatron>/tokenizer` by default, so a trained model converts back with its tokenizer.

Before training, the tokenizer's vocabulary is checked against the model's: a tokenizer that can
produce ids the embedding does not have is one clear error.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..checkpoint.args import SP_DEFAULT_KIND, SP_KIND, SP_KINDS, SP_MODEL, TOKENIZER_FILES, tokenizer_args
from ..conversion.hf_writer import copy_tokenizer
from ..errors import ConfigError

SUBDIR = "tokenizer"


def _has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)


_BPE_FOLDERS: dict[tuple[str, str], Path] = {}
_SP_FOLDERS: dict[tuple[str, str], Path] = {}


def _temp_folder(prefix: str) -> Path:
    import atexit
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)  # removed when the process ends
    return folder


def gpt2_bpe_folder(vocab_file: str, merge_file: str) -> Path:
    """Megatron-LM's GPT2BPETokenizer (--vocab-file, --merge-file) as a transformers tokenizer folder,
    written once per process into a temporary folder (removed at exit)."""
    key = (os.path.abspath(vocab_file), os.path.abspath(merge_file))
    if key not in _BPE_FOLDERS:
        from ..data.tokenizers import build_tokenizer
        tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file).tokenizer
        folder = _temp_folder("hf_megatron_gpt2_bpe_")
        tokenizer.save_pretrained(str(folder))
        _BPE_FOLDERS[key] = folder
    return _BPE_FOLDERS[key]


def sentencepiece_folder(model_file: str, kind: str) -> Path:
    """A SentencePiece `.model` file (Megatron-LM's SentencePiece tokenizer kinds) as a folder holding
    `tokenizer.model` and `megatron_tokenizer.json` (the kind), written once per process into a
    temporary folder (removed at exit); a file SentencePiece cannot read is one error here."""
    key = (os.path.abspath(model_file), kind)
    if key not in _SP_FOLDERS:
        from ..data.tokenizers import build_tokenizer
        build_tokenizer(kind, tokenizer_model=model_file)  # refuses a damaged file
        folder = _temp_folder("hf_megatron_sentencepiece_")
        shutil.copyfile(model_file, folder / SP_MODEL)
        (folder / SP_KIND).write_text(json.dumps({"tokenizer_type": kind}) + "\n", encoding="utf-8")
        _SP_FOLDERS[key] = folder
    return _SP_FOLDERS[key]


def _hub_tokenizer(repo_id: str, flag: str) -> Path:
    """A Hub repo's tokenizer files only (fetched, or found in the cache)."""
    if repo_id.startswith((".", "/", "~")) or repo_id.count("/") > 1:
        raise ConfigError(f"{flag}: {repo_id}: no such file or folder")
    from huggingface_hub import snapshot_download
    from ..conversion.hf_io import TOKENIZER_FILES as HF_TOKENIZER_FILES
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HF_TOKENIZER_FILES)))
    except Exception as exc:  # offline, unknown repo, auth: which and why in one line
        raise ConfigError(f"{flag}: {repo_id} is not a local file or folder and could not be fetched from the Hub "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def _given_tokenizer(path: str, kind: str | None) -> Path:
    """--tokenizer-model: a SentencePiece .model file, a tokenizer folder or a Hub id."""
    flag = "RunConfig.tokenizer_model (--tokenizer-model)"
    if os.path.isfile(path):
        if kind not in (None, *SP_KINDS):
            raise ConfigError(f"{flag}: --tokenizer-type {kind} reads a tokenizer folder or Hub id, got the file "
                              f"{path} (a SentencePiece .model file is --tokenizer-type {SP_DEFAULT_KIND} or "
                              f"Llama2Tokenizer)")
        return sentencepiece_folder(path, kind or SP_DEFAULT_KIND)
    if kind in SP_KINDS:
        raise ConfigError(f"{flag}: --tokenizer-type {kind} reads a SentencePiece .model file, got {path}")
    folder = Path(path) if os.path.isdir(path) else _hub_tokenizer(path, flag)
    if not _has_tokenizer(folder):
        raise ConfigError(f"{flag}: {path} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    return folder


def tokenizer_source(run) -> Path | None:
    """The folder of tokenizer files this run uses, or None."""
    if getattr(run, "tokenizer_type", None) == "NullTokenizer":
        return None
    if getattr(run, "vocab_file", None):
        return gpt2_bpe_folder(run.vocab_file, run.merge_file)
    if run.tokenizer_model:
        return _given_tokenizer(run.tokenizer_model, getattr(run, "tokenizer_type", None))
    candidates = []
    for path in (run.hf_model, run.hf_config):
        if path:
            candidates.append(path if os.path.isdir(path) else os.path.dirname(path))
    for megatron in (getattr(run, "pretrained_checkpoint", None), run.load):
        if megatron:
            candidates.append(os.path.join(megatron, SUBDIR))
            candidates.append(megatron)  # an HF folder given as --pretrained-checkpoint
    for candidate in candidates:
        if candidate and _has_tokenizer(Path(candidate)):
            return Path(candidate)
    return None


def vocab_size_of(folder: Path) -> int | None:
    """Ids the tokenizer can produce (vocabulary + added tokens), read from its files; None if unknown."""
    try:
        if (folder / "tokenizer.json").is_file():
            data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = (data.get("model") or {}).get("vocab")
            ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab or [])))
            ids |= {t["id"] for t in data.get("added_tokens") or [] if isinstance(t, dict) and "id" in t}
            return max(ids) + 1 if ids else None
        if (folder / "vocab.json").is_file():
            vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
            return max(vocab.values()) + 1 if vocab else None
        if (folder / SP_MODEL).is_file():
            import sentencepiece
            return sentencepiece.SentencePieceProcessor(model_file=str(folder / SP_MODEL)).get_piece_size()
    except (OSError, ValueError, TypeError, AttributeError, RuntimeError):
        return None
    return None


def check_vocab(folder: Path | None, model_vocab_size: int) -> None:
    if folder is None:
        return
    size = vocab_size_of(folder)
    if size is not None and size > model_vocab_size:
        raise ConfigError(f"{folder}: the tokenizer produces ids up to {size - 1}, but the model's vocabulary has "
                          f"{model_vocab_size} rows; use the model's own tokenizer (--tokenizer-model)")


def tokenizer_entry(folder: Path | None, save: str | os.PathLike) -> dict:
    """Megatron-LM's tokenizer args naming the copy in `<save>/tokenizer`."""
    return tokenizer_args(folder, Path(save).absolute() / SUBDIR)  # NullTokenizer when folder is None


def copy_into_save(folder: Path | None, save: str | os.PathLike) -> None:
    """Copy the tokenizer files into `<save>/tokenizer` once (a temp folder renamed into place)."""
    if folder is None:
        return
    target = Path(save) / SUBDIR
    if target.exists() or target.resolve() == folder.resolve():
        return
    temp = Path(save) / f".{SUBDIR}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    copy_tokenizer(folder, temp)
    os.replace(temp, target)
