"""A small Llama-style language model on real text every machine has: Python's own standard library.

Nothing is downloaded. The corpus is the `.py` files of `sysconfig.get_paths()["stdlib"]`; a byte-level BPE
tokenizer is trained on it offline (the `tokenizers` library, about 2 s) and kept in a folder that
`transformers.AutoTokenizer.from_pretrained` loads; the model is a `LlamaForCausalLM` built from a
`LlamaConfig` (random weights). Two runs, from examples/ (docs/language-models.md#the-example):

    acc-trainer --config stdlib_lm.yaml        # every weight trained from random ones: the library minus its tests
    acc-trainer --config stdlib_lm_lora.yaml   # LoRA on test/, starting from the first run's weights

Files go to train or eval by a hash of their path (the same split on every machine and process), and are
taken in the order of that hash, so `max_files` keeps a sample of every package, not the first in the
alphabet. `blocks` is the same text cut into equal blocks (Hugging Face's `run_clm.py` way), for
`acc-trainer bench-lm` (acc_trainer/tools/lm_bench.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path

import torch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EOS = "<|endoftext|>"  # token 0: ends every file, and pads
VOCAB = 1024
TOKENIZER = "runs/stdlib-tokenizer"  # relative to the working folder: beside the runs, out of version control


TESTS = ("test", "tests", "idle_test")  # the folders of the library's own test suites


def sources(packages: list[str] | None = None, exclude: list[str] = TESTS) -> list[Path]:
    """The library's .py files (its site-packages left out), in the order of a hash of their path: those
    under the top-level folders `packages` ("" for the top-level modules), else all but those with a folder
    named in `exclude` anywhere in their path (by default every test suite: test/, ctypes/test/, ...)."""
    files = []
    for path in STDLIB.rglob("*.py"):
        folders = path.relative_to(STDLIB).parts[:-1]
        if "site-packages" in folders:
            continue
        if (packages is not None and (folders[:1] or ("",))[0] in packages) or \
                (packages is None and not set(folders) & set(exclude)):
            files.append(path)
    return sorted(files, key=lambda p: (_hash(p), str(p)))


def _hash(path: Path) -> int:
    return zlib.crc32(path.relative_to(STDLIB).as_posix().encode())  # not hash(): that changes per process


def split(files: list[Path], eval_percent: int = 5) -> tuple[list[Path], list[Path]]:
    """(train, eval): a file is in eval when the hash of its path falls in the first `eval_percent` of 100."""
    held_out = [p for p in files if _hash(p) % 100 < eval_percent]
    return [p for p in files if _hash(p) % 100 >= eval_percent], held_out


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def tokenizer(folder: str = TOKENIZER, vocab_size: int = VOCAB):
    """The byte-level BPE tokenizer of the training files (the test suites left out), trained once and kept in
    `folder` (trained again when the Python version, the files or the vocabulary asked differ)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    files = split(sources())[0]
    made_from = {"python": sys.version.split()[0], "files": len(files), "vocab_size": vocab_size}
    recorded = folder / "corpus.json"
    if not (recorded.is_file() and json.loads(recorded.read_text()) == made_from):
        _train_tokenizer(folder, files, made_from)
    return AutoTokenizer.from_pretrained(folder)


def _train_tokenizer(folder: Path, files: list[Path], made_from: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=made_from["vocab_size"], special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((_read(p) for p in files), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    # Written next to its place and renamed into it: processes that start together each train one, and
    # whichever renames first wins; none ever reads a half-written folder.
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    wrapped.save_pretrained(staging)
    (staging / "corpus.json").write_text(json.dumps(made_from))
    try:
        staging.rename(folder)
    except OSError:  # the folder is there: another process's (then keep it), or a stale one (replace it)
        recorded = folder / "corpus.json"
        if not (recorded.is_file() and json.loads(recorded.read_text()) == made_from):
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        shutil.rmtree(staging, ignore_errors=True)


def _token_ids(files: list[Path], tok, max_length: int) -> list[dict]:
    """Each file's tokens, EOS at its end, cut into pieces of at most `max_length` (the model's context)."""
    eos = tok.convert_tokens_to_ids(EOS)
    texts = [_read(p) for p in files]
    encoded = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    pieces = []
    for e in encoded:
        ids = torch.tensor(e.ids + [eos], dtype=torch.long)
        pieces += [{"input_ids": piece} for piece in ids.split(max_length)]
    return pieces


def documents(packages: list[str] | None = None, exclude: list[str] = TESTS, max_files: int | None = None,
              max_eval_files: int | None = None, max_length: int = 512, eval_percent: int = 5,
              tokenizer_dir: str = TOKENIZER):
    """`--dataset stdlib_lm:documents`: (train, eval) lists of {"input_ids"}, one per file (a long file in
    pieces of `max_length` tokens), for `--pack` or a padding collate."""
    tok = tokenizer(tokenizer_dir)
    train, held_out = split(sources(packages, exclude), eval_percent)
    return _token_ids(train[:max_files], tok, max_length), _token_ids(held_out[:max_eval_files], tok, max_length)


def blocks(length: int = 256, packages: list[str] | None = None, exclude: list[str] = TESTS,
           max_files: int | None = None, max_eval_files: int | None = None, eval_percent: int = 5,
           tokenizer_dir: str = TOKENIZER):
    """`--dataset stdlib_lm:blocks`: the same files joined (EOS between them) and cut into blocks of `length`
    tokens, labels = input_ids, the tail dropped: every sample the same shape, every label trained, with no
    collate and no per-document attention (Hugging Face's `run_clm.py` does this). The speed bench's data."""
    tok = tokenizer(tokenizer_dir)
    train, held_out = split(sources(packages, exclude), eval_percent)

    def cut(files: list[Path]) -> list[dict]:
        ids = torch.cat([d["input_ids"] for d in _token_ids(files, tok, 1 << 30)] or [torch.zeros(0, dtype=torch.long)])
        rows = ids[: len(ids) // length * length].view(-1, length)
        return [{"input_ids": row, "labels": row.clone()} for row in rows]

    return cut(train[:max_files]), cut(held_out[:max_eval_files])


def llama(vocab_size: int = VOCAB, hidden_size: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
          intermediate_size: int = 384, max_length: int = 512):
    """`--model stdlib_lm:llama`: a Llama-style causal LM from its config (random weights, 0.9 M parameters
    by default), embeddings tied to the output layer, dropout off; token 0 (EOS) ends generation and pads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_length, tie_word_embeddings=True, attention_dropout=0.0,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


if __name__ == "__main__":  # python stdlib_lm.py: the corpus, tokenizer and model, in figures
    tok = tokenizer()
    train, held_out = split(sources())
    print(f"{len(train)} training and {len(held_out)} evaluation files under {STDLIB} (test suites left out); "
          f"tokenizer of {len(tok)} tokens in {TOKENIZER}; model of "
          f"{sum(p.numel() for p in llama().parameters()):,} parameters")
