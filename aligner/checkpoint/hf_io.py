"""Files of a Hugging Face checkpoint directory: lazy tensor reading, sharded safetensors writing, tokenizer files.

- `HFReader(dir)` opens `model.safetensors[.index.json]` or `pytorch_model.bin[.index.json]` (sharded or not) and
  reads one tensor at a time (`get`), with shapes and dtypes available before any data is read (`shape`, `dtype`).
  safetensors are read through `safe_open`; .bin files are memory-mapped (`torch.load(mmap=True)`).
- `SafetensorsWriter(dir, max_shard_bytes)` takes tensors one at a time and flushes a shard whenever the next
  tensor would overflow it, so at most one shard is held; `close()` names the shards `model-0000k-of-0000n` (or
  `model.safetensors` when there is one) and writes the index, as `save_pretrained` does.
- Tokenizer files are copied byte for byte (`copy_tokenizer`); `tokenizer_size` counts the tokens (with added ones).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
EXTRA_FILES = ("generation_config.json",)  # copied along with the model in both directions

_SAFE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class HFReader:
    """Lazy access to the tensors of an HF checkpoint directory (see module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.format, self._file_of = self._index(directory)
        self._handles: dict[str, object] = {}

    @staticmethod
    def _index(directory: str) -> tuple[str, dict[str, str]]:
        for index_name, fmt in ((SAFE_INDEX, "safetensors"), (BIN_INDEX, "bin")):
            path = os.path.join(directory, index_name)
            if os.path.isfile(path):
                with open(path) as f:
                    weight_map = json.load(f).get("weight_map")
                if not weight_map:
                    raise FileNotFoundError(f"{path} has no 'weight_map': the index is damaged")
                missing = sorted({s for s in weight_map.values() if not os.path.isfile(os.path.join(directory, s))})
                if missing:
                    raise FileNotFoundError(
                        f"{path} lists shard(s) that are not in {directory}: {missing[:3]}"
                        f"{' ...' if len(missing) > 3 else ''} (incomplete download?)"
                    )
                return fmt, dict(weight_map)
        if os.path.isfile(os.path.join(directory, SAFE_SINGLE)):
            with _open_safetensors(os.path.join(directory, SAFE_SINGLE)) as f:
                return "safetensors", {k: SAFE_SINGLE for k in f.keys()}
        if os.path.isfile(os.path.join(directory, BIN_SINGLE)):
            state = _load_bin(os.path.join(directory, BIN_SINGLE))
            return "bin", {k: BIN_SINGLE for k in state}
        raise FileNotFoundError(
            f"no weights in {directory}: expected one of {SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX}, "
            f"{BIN_SINGLE} (a directory written by save_pretrained)"
        )

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(name)
        file = self._file_of[name]
        if file not in self._handles:
            path = os.path.join(self.directory, file)
            if self.format == "safetensors":
                self._handles[file] = _open_safetensors(path)
            else:
                self._handles[file] = _load_bin(path)
        return self._handles[file]

    def shape(self, name: str) -> tuple:
        h = self._handle(name)
        return tuple(h.get_slice(name).get_shape()) if self.format == "safetensors" else tuple(h[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        h = self._handle(name)
        return _SAFE_DTYPES[h.get_slice(name).get_dtype()] if self.format == "safetensors" else h[name].dtype

    def get(self, name: str) -> torch.Tensor:
        h = self._handle(name)
        try:
            return h.get_tensor(name) if self.format == "safetensors" else h[name]
        except Exception as exc:  # noqa: BLE001 - a file damaged past its header
            raise _unreadable(os.path.join(self.directory, self._file_of[name]), exc) from exc

    def close(self) -> None:
        self._handles.clear()


class HFFileError(ValueError):
    """A weights file that cannot be read (truncated, damaged, not what its name says)."""


def _unreadable(path: str, exc: BaseException) -> HFFileError:
    return HFFileError(
        f"{path} cannot be read ({str(exc)[:200] or type(exc).__name__}): a truncated or damaged file? "
        "Copy or download it again"
    )


def _open_safetensors(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, "pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise _unreadable(path, exc) from exc


def _load_bin(path: str) -> dict:
    try:
        try:
            # mmap keeps the file's pages out of resident memory until a tensor is touched.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise _unreadable(path, exc) from exc


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r}: write e.g. 5GB, 500MB or a number of bytes")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * base**power)


class SafetensorsWriter:
    """Writes tensors into size-capped safetensors shards as they arrive (see module docstring)."""

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        # A private contiguous copy: the source may be a view of a model parameter, and safetensors refuses tensors
        # that share storage within one file.
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp_name = f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, os.path.join(self.directory, tmp_name), metadata={"format": "pt"})
        self._shards.append((tmp_name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish the last shard, give the shards their final names, write the index; returns the file names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(os.path.join(self.directory, self._shards[0][0]), os.path.join(self.directory, SAFE_SINGLE))
            return [SAFE_SINGLE]
        weight_map, files = {}, []
        for k, (tmp_name, names) in enumerate(self._shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.directory, tmp_name), os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
            files.append(final)
        with open(os.path.join(self.directory, SAFE_INDEX), "w") as f:
            json.dump(
                {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                f,
                indent=2,
            )
        return files + [SAFE_INDEX]


def copy_tokenizer(src: str, dst_dir: str) -> list[str]:
    """Copy the tokenizer files of `src` (an HF directory, or a lone tokenizer.json) into `dst_dir`."""
    os.makedirs(dst_dir, exist_ok=True)
    if os.path.isfile(src):
        if os.path.basename(src) != "tokenizer.json":
            raise FileNotFoundError(f"{src}: a tokenizer path is a directory or a tokenizer.json file")
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=src).save_pretrained(dst_dir)
        return sorted(os.listdir(dst_dir))
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))]
    if not any(
        name in copied for name in ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
    ):
        raise FileNotFoundError(
            f"no tokenizer in {src} (looked for tokenizer.json, tokenizer.model, vocab.json + "
            "merges.txt, vocab.txt): pass --tokenizer DIR with the model's tokenizer files"
        )
    for name in copied:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst_dir, name))
    return copied


def tokenizer_size(path: str) -> int:
    """Number of token ids the tokenizer at `path` can produce (base vocabulary plus added tokens)."""
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError) as exc:
        # AutoTokenizer may need a config.json to pick the class; a tokenizer.json alone still gives the count.
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return tokenizer_size(os.path.join(path, "tokenizer.json"))
        raise FileNotFoundError(f"cannot load the tokenizer in {path}: {exc}") from exc


def copy_extras(src_dir: str, dst_dir: str) -> None:
    for name in EXTRA_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
