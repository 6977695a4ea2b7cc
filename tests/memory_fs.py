"""An in-memory pyarrow filesystem for tests, on pyarrow's public `FileSystemHandler` API: files are bytes in a
dict, directories a set (a file's parent directories exist as soon as it does, as in an object store).

    filesystem = memory_filesystem()           # a pyarrow.fs.PyFileSystem
    with filesystem.open_output_stream("bucket/a/b.json") as out:
        out.write(b"{}")
"""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
from pyarrow import fs as arrow_fs


class _Output(io.BytesIO):
    """A file being written: it appears whole, in `files`, when closed."""

    def __init__(self, files: dict[str, bytes], path: str, initial: bytes = b"") -> None:
        super().__init__()
        self.write(initial)
        self._files, self._path = files, path

    def close(self) -> None:
        if not self.closed:
            self._files[self._path] = self.getvalue()
        super().close()


class MemoryHandler(arrow_fs.FileSystemHandler):
    """Files and directories held in memory; paths are '/'-separated, without a leading '/'."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = set()

    # -- paths ---------------------------------------------------------------------------------------

    @staticmethod
    def _clean(path: str) -> str:
        return path.strip("/")

    def _parents(self, path: str) -> list[str]:
        parts = self._clean(path).split("/")
        return ["/".join(parts[:i]) for i in range(1, len(parts))]

    def _is_dir(self, path: str) -> bool:
        path = self._clean(path)
        return path == "" or path in self.dirs or any(f.startswith(path + "/") for f in list(self.files))

    def _info(self, path: str) -> arrow_fs.FileInfo:
        path = self._clean(path)
        data = self.files.get(path)
        if data is not None:
            return arrow_fs.FileInfo(path, arrow_fs.FileType.File, size=len(data))
        if self._is_dir(path):
            return arrow_fs.FileInfo(path, arrow_fs.FileType.Directory)
        return arrow_fs.FileInfo(path, arrow_fs.FileType.NotFound)

    def _below(self, path: str) -> list[str]:
        """Every file and directory under `path` (not `path` itself)."""
        prefix = self._clean(path) + "/" if self._clean(path) else ""
        # Over copies (one call each): builders on other threads write while one lists.
        found = {f for f in list(self.files) if f.startswith(prefix)}
        found |= {d for d in list(self.dirs) if d.startswith(prefix)}
        for f in list(found):
            found.update(p for p in self._parents(f) if p.startswith(prefix))
        return sorted(found)

    # -- FileSystemHandler --------------------------------------------------------------------------

    def get_type_name(self) -> str:
        return "memory"

    def normalize_path(self, path: str) -> str:
        return self._clean(path)

    def equals(self, other: Any) -> bool:
        return other is self

    def get_file_info(self, paths: list[str]) -> list[arrow_fs.FileInfo]:
        return [self._info(path) for path in paths]

    def get_file_info_selector(self, selector: arrow_fs.FileSelector) -> list[arrow_fs.FileInfo]:
        base = self._clean(selector.base_dir)
        if not self._is_dir(base) or base in self.files:
            if selector.allow_not_found:
                return []
            raise FileNotFoundError(f"{selector.base_dir}: no such directory")
        depth = base.count("/") + 1 if base else 0
        below = self._below(base)
        if not selector.recursive:
            below = [p for p in below if p.count("/") == depth]
        return [self._info(p) for p in below]

    def create_dir(self, path: str, recursive: bool) -> None:
        path = self._clean(path)
        parents = self._parents(path)
        if not recursive and parents and not self._is_dir(parents[-1]):
            raise FileNotFoundError(f"{path}: the parent directory does not exist")
        self.dirs.update([*parents, path])

    def delete_dir(self, path: str) -> None:
        path = self._clean(path)
        if not self._is_dir(path):
            raise FileNotFoundError(f"{path}: no such directory")
        self.delete_dir_contents(path, False)
        self.dirs.discard(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        path = self._clean(path)
        if not self._is_dir(path):
            if missing_dir_ok:
                return
            raise FileNotFoundError(f"{path}: no such directory")
        self.dirs.add(path)  # the directory itself stays
        for p in self._below(path):
            self.files.pop(p, None)
            self.dirs.discard(p)

    def delete_root_dir_contents(self) -> None:
        self.files.clear()
        self.dirs.clear()

    def delete_file(self, path: str) -> None:
        path = self._clean(path)
        if path not in self.files:
            raise FileNotFoundError(f"{path}: no such file")
        self.dirs.update(self._parents(path))  # its directory stays when it was the last file
        del self.files[path]

    def move(self, src: str, dest: str) -> None:
        src, dest = self._clean(src), self._clean(dest)
        if src in self.files:
            self.dirs.update(self._parents(dest))
            self.files[dest] = self.files.pop(src)
            return
        if not self._is_dir(src):
            raise FileNotFoundError(f"{src}: no such file or directory")
        for p in self._below(src):
            moved = dest + p[len(src) :]
            if p in self.files:
                self.files[moved] = self.files.pop(p)
            else:
                self.dirs.discard(p)
                self.dirs.add(moved)
        self.dirs.discard(src)
        self.dirs.add(dest)

    def copy_file(self, src: str, dest: str) -> None:
        src, dest = self._clean(src), self._clean(dest)
        if src not in self.files:
            raise FileNotFoundError(f"{src}: no such file")
        self.dirs.update(self._parents(dest))
        self.files[dest] = self.files[src]

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.open_input_file(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        path = self._clean(path)
        if path not in self.files:
            raise FileNotFoundError(f"{path}: no such file")
        return pa.PythonFile(io.BytesIO(self.files[path]), mode="r")

    def open_output_stream(self, path: str, metadata: Any = None) -> pa.NativeFile:
        path = self._clean(path)
        self.dirs.update(self._parents(path))
        return pa.PythonFile(_Output(self.files, path), mode="w")

    def open_append_stream(self, path: str, metadata: Any = None) -> pa.NativeFile:
        path = self._clean(path)
        self.dirs.update(self._parents(path))
        return pa.PythonFile(_Output(self.files, path, self.files.get(path, b"")), mode="w")


def memory_filesystem() -> arrow_fs.PyFileSystem:
    """A new, empty in-memory pyarrow filesystem."""
    return arrow_fs.PyFileSystem(MemoryHandler())
