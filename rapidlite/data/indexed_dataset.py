"""Megatron-LM's mmap indexed dataset: token sequences in a ``.bin`` file described by an ``.idx`` file.

The format is byte-compatible with ``megatron/core/datasets/indexed_dataset.py``, so data preprocessed
here trains under Megatron-LM and the other way round. ``PREFIX.idx`` is little-endian:

=================  ===================================================================================
magic              9 bytes ``MMIDIDX\\x00\\x00``
version            ``<Q`` = 1
dtype code         ``<B``: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
sequence_count     ``<Q``
document_count     ``<Q``: entries of ``document_indices`` (documents + 1)
sequence_lengths   int32[sequence_count], in tokens
sequence_pointers  int64[sequence_count], byte offsets into ``.bin``
document_indices   int64[document_count]: 0, then for each document the sequence index one past its end
=================  ===================================================================================

``PREFIX.bin`` is the token arrays of every sequence, concatenated, in that dtype, without a header. A
document is one sequence, or several when sentences were split (``document_indices`` groups them).
Megatron's multimodal variant appends a ``sequence_modes`` int8 array; it is tolerated and ignored.

Reading maps both files: ``dataset[i]`` is a zero-copy, read-only numpy view of the ``.bin`` map. The
header, the array sizes, ``document_indices`` and the ``.bin`` size are checked on open, so a truncated
or foreign file gives one :class:`~rapidlite.errors.DataError` line instead of garbage; a sequence whose
pointer or length lies outside ``.bin`` (a corrupt index that got past those checks) errors when read.
"""

from __future__ import annotations

import array
import os
import shutil
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from rapidlite.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence_count, document_count

DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODES = {np.dtype(t): code for code, t in DTYPES.items()}


def best_dtype(vocab_size: int | None) -> type:
    """Megatron's choice: ``uint16`` for vocabularies below 65500 tokens, else ``int32``."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(path_prefix: str) -> str:
    return f"{path_prefix}.bin"


def index_file_path(path_prefix: str) -> str:
    return f"{path_prefix}.idx"


def dtype_code(dtype: Any) -> int:
    """The ``.idx`` code of a numpy dtype (ValueError for one the format cannot store)."""
    try:
        return _CODES[np.dtype(dtype)]
    except (KeyError, TypeError):
        names = ", ".join(np.dtype(t).name for t in DTYPES.values())
        raise ValueError(f"dtype {dtype!r} cannot be stored in a Megatron index; use one of {names}") from None


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx``: ``len()`` sequences, ``ds[i]`` a numpy array.

    ``path_prefix`` may also be given with its ``.bin``/``.idx`` suffix. With ``mmap=False`` the ``.bin``
    is read into memory instead of being mapped. ``dtype`` is a ``numpy.dtype``."""

    def __init__(self, path_prefix: str | os.PathLike, mmap: bool = True) -> None:
        prefix = os.fspath(path_prefix)
        if prefix.endswith((".bin", ".idx")) and not os.path.isfile(index_file_path(prefix)):
            prefix = prefix[:-4]
        self.path_prefix, self.mmap = prefix, mmap
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(
                    f"{path}: no such file; build the dataset with rapidlite-preprocess (--data-path and "
                    "--output-prefix name the prefix, without .bin/.idx)"
                )
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(HEADER.size)
        if head[: len(MAGIC)] != MAGIC:
            raise DataError(
                f"{idx_path}: not a Megatron mmap index (bad magic {head[: len(MAGIC)]!r}, expected {MAGIC!r}); "
                "rebuild it with rapidlite-preprocess"
            )
        if len(head) < HEADER.size:
            raise DataError(f"{idx_path}: truncated index ({idx_size} bytes, the header alone needs {HEADER.size})")
        _, version, code, sequence_count, document_count = HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{idx_path}: unsupported index version {version} (only version {VERSION} is known)")
        if code not in DTYPES:
            raise DataError(f"{idx_path}: unknown dtype code {code} (known: 1-8); the index is corrupt")
        self.dtype = np.dtype(DTYPES[code])
        needed = HEADER.size + sequence_count * (4 + 8) + document_count * 8
        if idx_size < needed:
            raise DataError(
                f"{idx_path}: truncated index ({idx_size} bytes, but its header promises {sequence_count} sequences "
                f"and {document_count} document indices, {needed} bytes); re-run the preprocessing"
            )
        if document_count < 1:
            raise DataError(f"{idx_path}: document_indices is empty (it must hold at least the leading 0)")

        self.index_buffer_mmap = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(self.index_buffer_mmap, "<i4", sequence_count, offset)
        offset += sequence_count * 4
        self.sequence_pointers = np.frombuffer(self.index_buffer_mmap, "<i8", sequence_count, offset)
        offset += sequence_count * 8
        self.document_indices = np.frombuffer(self.index_buffer_mmap, "<i8", document_count, offset)

        docs = self.document_indices
        if docs[0] != 0:
            raise DataError(f"{idx_path}: document_indices starts at {docs[0]}, not 0; the index is corrupt")
        if document_count > 1 and bool((np.diff(docs) < 0).any()):
            raise DataError(f"{idx_path}: document_indices decreases somewhere; the index is corrupt")
        if docs[-1] != sequence_count:
            raise DataError(
                f"{idx_path}: document_indices ends at {docs[-1]} but there are {sequence_count} sequences; "
                "the index is corrupt"
            )

        if sequence_count and bool((self.sequence_lengths < 0).any()):
            raise DataError(f"{idx_path}: negative sequence lengths; the index is corrupt (re-run the preprocessing)")
        if sequence_count > 1:
            ends = self.sequence_pointers[:-1] + self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize
            if bool((self.sequence_pointers[1:] != ends).any()) or self.sequence_pointers[0] != 0:
                raise DataError(
                    f"{idx_path}: sequence pointers do not follow the sequence lengths; the index is corrupt "
                    "(re-run the preprocessing)"
                )
        bin_size = os.path.getsize(bin_path)
        expected = 0
        if sequence_count:
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if bin_size != expected:
            raise DataError(
                f"{bin_path}: {bin_size} bytes, but {idx_path} describes {expected}; the files are truncated or do "
                "not belong together (re-run rapidlite-preprocess)"
            )
        self.bin_buffer_mmap: np.memmap | None = None
        if bin_size == 0:  # numpy cannot map an empty file
            self.bin_buffer = np.zeros(0, np.uint8)
        elif self.mmap:
            self.bin_buffer_mmap = np.memmap(bin_path, dtype=np.uint8, mode="r")
            self.bin_buffer = self.bin_buffer_mmap.view(np.ndarray)
        else:
            self.bin_buffer = np.fromfile(bin_path, dtype=np.uint8)
            self.bin_buffer.flags.writeable = False

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the maps
        return {"path_prefix": self.path_prefix, "mmap": self.mmap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path_prefix, self.mmap = state["path_prefix"], state["mmap"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def get(self, idx: int | np.integer, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        n = len(self)
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for a dataset of {n} sequences")
        size = int(self.sequence_lengths[idx])
        if size < 0:
            raise DataError(
                f"{index_file_path(self.path_prefix)}: sequence {idx} has length {size}; the index is corrupt"
            )
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of {size} tokens")
        itemsize = self.dtype.itemsize
        start = int(self.sequence_pointers[idx]) + offset * itemsize
        view = self.bin_buffer[max(start, 0) : start + length * itemsize]
        if start < 0 or len(view) != length * itemsize:
            raise DataError(
                f"{index_file_path(self.path_prefix)}: sequence {idx} lies outside "
                f"{data_file_path(self.path_prefix)}; the index is corrupt"
            )
        return view.view(self.dtype)

    def max_token_id(self) -> int:
        """The largest token id in the ``.bin`` (one pass over it, in chunks; -1 when empty)."""
        tokens = self.bin_buffer.view(self.dtype) if len(self.bin_buffer) else np.zeros(0, self.dtype)
        chunk = 1 << 26
        return max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)

    def get_document_indices(self) -> np.ndarray:
        return self.document_indices

    @property
    def sizes(self) -> np.ndarray:  # the names of Megatron's older MMapIndexedDataset
        return self.sequence_lengths

    @property
    def doc_idx(self) -> np.ndarray:
        return self.document_indices

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @staticmethod
    def exists(path_prefix: str | os.PathLike) -> bool:
        """Whether both ``PREFIX.idx`` and ``PREFIX.bin`` exist."""
        prefix = os.fspath(path_prefix)
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexedDatasetBuilder:
    """Writes ``.bin`` as sequences arrive and ``.idx`` at :meth:`finalize`.

    ``add_item`` appends one sequence, ``end_document`` closes the current document (``finalize`` closes
    a last one left open); ``add_index`` appends a whole existing dataset (merging partitions)."""

    def __init__(self, bin_path: str | os.PathLike, dtype: Any = np.int32) -> None:
        dtype_code(dtype)  # refuse an unstorable dtype before creating any file
        self.dtype = np.dtype(dtype)
        self.bin_path = os.fspath(bin_path)
        self.data_file = open(self.bin_path, "wb")
        self.sequence_lengths = array.array("q")
        self.document_indices = array.array("q", [0])

    def _as_array(self, tokens: Any) -> np.ndarray:
        if hasattr(tokens, "detach"):  # a torch tensor, without importing torch here
            tokens = tokens.detach().cpu().numpy()
        values = np.asarray(tokens)
        if values.ndim != 1:
            raise DataError(f"{self.bin_path}: a sequence must be 1-D, got shape {values.shape}")
        if values.size and self.dtype.kind in "iu":
            if values.dtype.kind not in "iu":
                raise DataError(f"{self.bin_path}: token ids must be integers, got {values.dtype}")
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise DataError(
                    f"{self.bin_path}: token id {high if high > info.max else low} does not fit "
                    f"{self.dtype.name}; build with a wider dtype (np.int32)"
                )
        return values.astype(self.dtype, copy=False)

    def add_item(self, tokens: Any) -> None:
        """Append one sequence (list, numpy array or torch tensor of token ids)."""
        values = self._as_array(tokens)
        self.data_file.write(values.tobytes(order="C"))
        self.sequence_lengths.append(len(values))

    def end_document(self) -> None:
        """Close the current document: the sequences since the previous call form one document."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Any, lengths: Iterable[int]) -> None:
        """Append one document: ``tokens`` cut into sequences of ``lengths`` tokens."""
        values = self._as_array(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != len(values) or any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths {lengths} do not partition a document of {len(values)} tokens")
        self.data_file.write(values.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.end_document()

    def add_index(self, path_prefix: str | os.PathLike) -> None:
        """Append every sequence and document of the dataset at ``path_prefix`` (same dtype)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{index_file_path(other.path_prefix)}: dtype {other.dtype.name} differs from the "
                f"{self.dtype.name} being written to {self.bin_path}; datasets must share a dtype to merge"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        bin_path = data_file_path(other.path_prefix)
        del other
        with open(bin_path, "rb") as f:
            shutil.copyfileobj(f, self.data_file, 16 << 20)

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Close ``.bin`` and write the index to ``idx_path``."""
        self.data_file.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()  # sequences after the last end_document form a final document
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64)
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise DataError(f"{self.bin_path}: a sequence of {lengths.max()} tokens exceeds the int32 index limit")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self.document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), len(lengths), len(documents)))
            f.write(lengths.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(documents.astype("<i8").tobytes(order="C"))
