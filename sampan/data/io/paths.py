"""Input paths: globs, directories and lists; compression; format by extension."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from sampan.errors import DataError


def expand_paths(spec: str | list[str]) -> list[Any]:
    """Files named by a path, a glob, a directory, or a list of those; sorted, must exist.
    A URI (``s3://bucket/logs/``, ``hdfs://host/path/*.csv``, ``file:///data/x.csv``) names
    files on a pyarrow filesystem, read as :class:`StreamInput` s."""
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[Any] = []
    for item in items:
        if "://" in item:
            out.extend(_uri_files(item))
            continue
        p = Path(os.path.expanduser(item))
        if p.is_dir():
            # skip hidden files and markers such as Spark's _SUCCESS
            out.extend(sorted(q for q in p.iterdir()
                              if q.is_file() and not q.name.startswith((".", "_"))))
        elif any(ch in item for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(item)))
            if not matches:
                raise DataError(f"no file matches {item!r}")
            out.extend(matches)
        elif p.exists():
            out.append(p)
        else:
            hint = "" if any(c in item for c in "/\\.") else \
                " (a processed split is named train, valid or test)"
            if not p.is_absolute():  # relative paths are read from where sampan runs
                hint += f" (relative to the current directory {os.getcwd()})"
            raise DataError(f"data file {item!r} does not exist{hint}")
    return out


def _uri_files(uri: str) -> list[StreamInput]:
    """The files a URI names on its pyarrow filesystem: one file, a folder's files (hidden
    ones and markers such as ``_SUCCESS`` left out) or a glob's matches, sorted."""
    import fnmatch
    from urllib.parse import urlsplit

    import pyarrow.fs as pafs

    where, _, query = uri.partition("?")  # ?region=...&endpoint_override=...: options
    parts = urlsplit(where)
    pattern = any(ch in where for ch in "*?[")
    base = where[: min(where.find(ch) for ch in "*?[" if ch in where)].rsplit("/", 1)[0] \
        if pattern else where
    try:
        fs, root = pafs.FileSystem.from_uri(base + (f"?{query}" if query else ""))
        info = fs.get_file_info(root)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"cannot open {uri!r}: {e}") from None
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data file {uri!r} does not exist")
    if info.type == pafs.FileType.File and not pattern:
        files = [root]
    else:
        try:
            listed = fs.get_file_info(pafs.FileSelector(root))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"cannot list {uri!r}: {e}") from None
        files = sorted(f.path for f in listed if f.type == pafs.FileType.File
                       and not f.base_name.startswith((".", "_")))
        if pattern:
            tail = where[len(base):].lstrip("/")
            files = [f for f in files if fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], tail)]
            if not files:
                raise DataError(f"no file matches {uri!r}")
    # as the user wrote it: hdfs://host:port/path keeps its host (the filesystem's paths
    # start at /), s3://bucket/key its bucket (they start with it)
    prefix = f"{parts.scheme}://" + (parts.netloc if root.startswith("/") else "")
    return [StreamInput(prefix + f, fs=fs, fs_path=f) for f in files]


_COMPRESSION = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2",
                ".lz4": "lz4"}


class StreamInput:
    """Records that are not a local file, read by the same readers as files: a run of
    Kafka messages held in memory (``data``, one record per line, the first being line
    ``first_line``: its offset), or a file on a pyarrow filesystem (``fs`` and ``fs_path``:
    HDFS, S3, ...). ``name`` is what rejects and errors call it."""

    def __init__(self, name: str, data: bytes | None = None, fs: Any = None,
                 fs_path: str | None = None, first_line: int = 1):
        self.display, self.data, self.fs, self.fs_path = name, data, fs, fs_path
        self.first_line = first_line
        self.name = Path(fs_path or name).name
        self.suffix = Path(self.name).suffix

    def __str__(self) -> str:
        return self.display

    def __repr__(self) -> str:
        return f"StreamInput({self.display!r})"

    def open(self) -> Any:
        if self.data is not None:
            return pa.BufferReader(self.data)
        return self.fs.open_input_stream(self.fs_path,
                                         compression=_COMPRESSION.get(self.suffix.lower()))

    def open_file(self) -> Any:
        """A random-access file (Parquet's footer is at the end)."""
        if self.data is not None:
            return pa.BufferReader(self.data)
        return self.fs.open_input_file(self.fs_path)


def open_input(path: Path | StreamInput) -> Any:
    """A binary input stream of ``path``, decompressed by its extension."""
    if isinstance(path, StreamInput):
        return path.open()
    return pa.input_stream(str(path), compression=_COMPRESSION.get(Path(path).suffix.lower()))


def first_line(path: Path | StreamInput) -> int:
    """The number of the input's first line (1 for a file; a message run's first offset)."""
    return path.first_line if isinstance(path, StreamInput) else 1


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    for ext in (".gz", ".zst", ".zstd", ".bz2"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(".parquet") or name.endswith(".pq"):
        return "parquet"
    if name.endswith(".tsv") or name.endswith(".txt") or name.endswith(".data"):
        return "tsv"
    if name.endswith(".jsonl") or name.endswith(".ndjson") or name.endswith(".json"):
        return "jsonl"
    if name.endswith(".libsvm") or name.endswith(".libfm") or name.endswith(".svm"):
        return "libsvm"
    return "csv"
