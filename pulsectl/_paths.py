"""The relative file paths a patch or a store manifest may name inside a checkpoint folder.

Both come from outside (a patch from a pipe, a manifest from a shared store), and pulsectl
writes files at these paths: a path that climbs out of the folder (``..``), starts at the
root, or names a dot-file (never part of a checkpoint) must be refused before anything is
written.
"""

from __future__ import annotations


def paths_problem(paths: list[str], layout: str) -> str | None:
    """Why ``paths`` (POSIX relative paths, in order) are not a checkpoint's files, or None.

    A single file (``layout == "file"``) is one path, empty; a folder's are non-empty, unique,
    sorted, each a plain relative path of names that do not start with a dot, without control
    characters (a newline in a name would let two folders' fingerprint texts be the same),
    none of them both a file and a folder.
    """
    if layout == "file":
        return None if paths == [""] else "a single file is named by exactly one empty path"
    if not paths or len(set(paths)) != len(paths) or paths != sorted(paths):
        return "file paths are empty, repeated or not sorted"
    for p in paths:
        parts = p.split("/")
        if (
            not p
            or p.startswith("/")
            or "\\" in p
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in p)  # NUL, newline, ...
            or any(part in ("", ".", "..") or part.startswith(".") for part in parts)
        ):
            return f"unsafe file path {p!r}"
    folders = {"/".join(p.split("/")[:k]) for p in paths for k in range(1, p.count("/") + 1)}
    clash = sorted(folders.intersection(paths))
    if clash:
        return f"{clash[0]!r} is both a file and a folder"
    return None
