"""Outputs that appear whole or not at all: temp file in the target folder, then rename."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shlex
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO, TypeVar

from pulsectl import _placed
from pulsectl.errors import InputError, OutputError, PulseError, UsageError, escape_controls

TEMP_MARK = ".pulsectl-tmp-"

T = TypeVar("T")

# How a path typed to mean a folder ends ('runs/', 'runs/.'); a Path drops both.
_FOLDER_ENDINGS = tuple(dict.fromkeys(f"{sep}{dot}" for dot in (".", "") for sep in "/" + os.sep))

# The signals that end a run the way Ctrl-C does (pulsectl.cli raises KeyboardInterrupt on the
# last two): its temps are removed first. SIGHUP comes when a terminal or tmux pane closes.
INTERRUPTS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


# Outputs that ``check_target`` found absent and may not replace (no -f): if one is there by
# the time the output is renamed into place, another process made it meanwhile (two runs with
# the same -o), and it is not replaced either.
_must_be_new: set[str] = set()


def put_in_place(tmp: Path | str, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path`` and record it (``pulsectl._placed``): an
    interrupt comes before both or after both. An output checked as absent without -f is only
    renamed where nothing has appeared at ``path`` since (OutputError otherwise)."""
    key = os.path.abspath(path)
    with interrupts_deferred():
        if key in _must_be_new:
            if not _rename_new(Path(tmp), path):
                raise OutputError(
                    f"{path}: output exists (another run wrote it meanwhile); pass -f to "
                    "overwrite (nothing was written)",
                    path=path,
                )
            _must_be_new.discard(key)
        else:
            os.replace(tmp, path)
        _placed.record(path)


_RENAME_NOREPLACE = 1


def _rename_new(tmp: Path, path: Path) -> bool:
    """Rename ``tmp`` to ``path`` where ``path`` does not exist; False, nothing done, where it
    does. In one step with renameat2 (Linux), else by a hard link (files); else the check and
    the rename are two steps."""
    done = _renameat2(tmp, path, _RENAME_NOREPLACE)
    if done is not None:
        return done
    if not tmp.is_dir():
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            pass  # no hard links here
        else:
            os.unlink(tmp)
            return True
    if os.path.lexists(path):
        return False
    os.replace(tmp, path)
    return True


def check_target(path: Path, force: bool, what: str = "output") -> None:
    """Refuse to clobber an existing path (but an empty folder) unless ``force``; refuse a
    missing parent folder, a device, pipe or socket (an output is renamed into place: it would
    replace the node), and '-', which means standard output to the commands that stream."""
    if str(path) == "-":
        raise UsageError(
            f"-o -: this command writes its {what} as a file, not to standard output; give a "
            "path (for a file named '-', its full path)"
        )
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise OutputError(
            f"{path}: is a device, pipe or socket, not a file; pulsectl writes a new file and "
            "renames it into place, which would replace it: give a file path",
            path=path,
        )
    empty_folder = mode is not None and stat.S_ISDIR(mode) and is_empty_folder(path)
    if mode is not None and not force and not empty_folder:
        raise OutputError(f"{path}: {what} exists; pass -f to overwrite", path=path)
    if mode is None and not force and not os.path.islink(path):
        _must_be_new.add(os.path.abspath(path))
    else:
        _must_be_new.discard(os.path.abspath(path))
    parent = path.parent
    if not parent.is_dir():
        raise missing_folder(path)


def missing_folder(path: Path) -> OutputError:
    """The error for an output whose folder is missing: outputs never create folders. Where a
    file stands in the way (``-o model.safetensors/out``), ``mkdir -p`` would fail: say so."""
    for above in (path.parent, *path.parent.parents):
        if os.path.lexists(above):
            if not above.is_dir():
                return OutputError(
                    f"{path}: {above} is not a folder; give a path in a folder for the output",
                    path=path,
                )
            break
    return OutputError(
        f"{path}: folder {path.parent} does not exist; create it first "
        f"(mkdir -p {shlex.quote(str(path.parent))})",
        path=path,
    )


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name the same existing file or folder (a link and what it points
    to, or two hard links, are one); ``-`` (a pipe) names none. For refusing an output that
    is one of the command's inputs."""
    if os.fspath(a) == "-" or os.fspath(b) == "-":
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def check_file_target(path: str | os.PathLike[str], force: bool, what: str = "output") -> Path:
    """``check_target`` for an output that is one file, as the user typed it; also refused: a
    path ending in '/' (see ``file_path``) and an existing folder. Returns it as a Path."""
    out = file_path(path, what)
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; give a file path for the {what}", path=out)
    check_target(out, force, what)
    return out


def file_path(path: str | os.PathLike[str], what: str = "output") -> Path:
    """``path`` as a Path, for an output that is one file; refused where it ends in '/' (or
    '/.'): whoever typed ``-o runs/`` means a folder, and would get a file named ``runs``
    (a Path drops the '/', so ask this before making one)."""
    text = os.fspath(path)
    end = next((e for e in _FOLDER_ENDINGS if text.endswith(e) and text != e), None)
    if end is not None:
        raise UsageError(
            f"{text}: ends with {end!r}, which names a folder, but the {what} is one file: "
            "give a file name (FOLDER/NAME to write it in a folder)"
        )
    return Path(text)


def refuse_inside_folder_input(
    out: str | os.PathLike[str], inputs: Sequence[object], what: str
) -> None:
    """UsageError when ``out`` lies inside one of ``inputs`` that is a folder checkpoint:
    every file in such a folder is part of the checkpoint, which would then no longer be the
    one this command read (a later apply or verify of it would refuse it)."""
    if os.fspath(out) == "-":
        return
    target = Path(out).resolve()
    for item in inputs:
        if not isinstance(item, (str, os.PathLike)) or os.fspath(item) == "-":
            continue
        folder = Path(item)
        if not folder.is_dir():
            continue
        root = folder.resolve()
        if target != root and target.is_relative_to(root):
            raise UsageError(
                f"{out}: is inside {item}, a folder checkpoint this command reads, which would "
                f"then hold it; write the {what} outside it"
            )


def check_folder_target(path: Path, inputs: Sequence[Path] = ()) -> None:
    """Before a folder output replaces the folder at ``path`` (with -f): refuse one that holds
    an input of the command or the current folder, or that holds files but no checkpoint.

    Replacing a folder replaces everything in it that a checkpoint does not leave out (hidden
    entries are carried over, see ``install``): a folder of other files (checkpoints hold their
    .safetensors files at the top, so ``runs/`` holding ``runs/run1/model.safetensors`` is not
    one) is most likely a mistyped -o, and one that holds BASE or a patch would lose them.
    """
    if not path.is_dir():
        return
    where = path.resolve()
    try:
        here = [Path.cwd()]
    except OSError:  # the current folder was removed
        here = []
    for item in [*inputs, *here]:
        if not item.exists():
            continue
        held = item.resolve()
        if held == where or held.is_relative_to(where):
            which = "the current folder" if item in here else f"{item}, an input"
            raise OutputError(
                f"{path}: holds {which}; replacing the folder would remove it: write the "
                "output to another folder",
                path=path,
            )
    try:
        with os.scandir(path) as entries:
            checkpoint = any(
                e.name.endswith(".safetensors") and not e.name.startswith(".") and e.is_file()
                for e in entries
            )
    except OSError:  # unreadable: the replacement itself will say why it cannot go on
        checkpoint = True
    if not checkpoint and _holds_visible_file(path):
        raise OutputError(
            f"{path}: is a folder of other files (no .safetensors file at its top); an output "
            "folder is replaced whole: give a new or empty folder, or remove this one first",
            path=path,
        )


def is_empty_folder(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is None
    except OSError:  # unreadable: not known to be empty
        return False


def _holds_visible_file(folder: Path) -> bool:
    """Whether ``folder`` holds a file that a folder checkpoint would hold (no hidden path
    component)."""
    for _, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(not name.startswith(".") for name in files):
            return True
    return False


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back while inside; one that arrives is acted on when
    leaving.

    For the steps between creating a temp file and recording it for removal: an interrupt (a
    KeyboardInterrupt, raised at whatever line runs when the signal comes) between the two
    would leave the file behind. Python runs signal handlers in the main thread only, so
    elsewhere this holds nothing back, and needs not.
    """
    sigs = INTERRUPTS
    # (None: a handler set outside Python, which cannot be put back: left alone.)
    if threading.current_thread() is not threading.main_thread() or any(
        signal.getsignal(s) is None for s in sigs
    ):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous: dict[int, Any] = {}
    try:
        for s in sigs:
            previous[s] = signal.signal(s, hold)
        yield
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
        if held:
            _deliver(held[0], previous[held[0]])


def _deliver(signum: int, handler: Any) -> None:
    """Act on a held signal as its handler would have."""
    if callable(handler):
        handler(signum, None)  # Python's SIGINT handler, pulsectl's SIGTERM one: they raise
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)


# Longest file name most filesystems take (ext4, xfs, btrfs, tmpfs: bytes).
NAME_MAX = 255
# Room left after a temp prefix: tempfile's 8 random characters, or 16 hex digits, and spare.
_TEMP_TAIL = 24


def temp_prefix(name: str, mark: str = TEMP_MARK) -> str:
    """``.NAME`` + ``mark``: how pulsectl names a temp beside ``NAME`` (the caller adds the
    random part). A long NAME is cut short, so that an output name the system takes (up to
    NAME_MAX bytes) still leaves room for its temp's."""
    room = NAME_MAX - _TEMP_TAIL - len(os.fsencode(mark)) - 1
    raw = os.fsencode(name)
    if len(raw) > room:
        name = os.fsdecode(raw[:room])  # a cut inside a character keeps its bytes as they are
    return f".{name}{mark}"


def temp_path(path: Path) -> Path:
    """A fresh hidden name in the folder of ``path`` (not created)."""
    # Creating it is the first write to the folder (read-only, full, no permission?). It is
    # removed again before an interrupt can end this function.
    with interrupts_deferred():
        try:
            fd, name = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
        except OSError as exc:
            raise os_error(exc, path) from exc
        os.close(fd)
        os.unlink(name)
    return Path(name)


def os_error(exc: OSError, path: Path) -> OutputError:
    """Turn a write failure into one clear line."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            f"{path}: no space left on device; free some space or write the output elsewhere",
            path=path,
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return OutputError(
            f"{path}: cannot write ({exc.strerror}); write the output elsewhere", path=path
        )
    return OutputError(f"{path}: cannot write: {exc.strerror}", path=path)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], force: bool, durable: bool = False
) -> Iterator[BinaryIO]:
    """Yield a temp file beside ``path``; on success it replaces ``path``, else it is removed.

    The rename is atomic for every other process whatever happens to this one (a kill leaves the
    old file or the new one). ``durable`` also fsyncs before the rename, so that a power loss
    cannot leave an empty file behind the new name.
    """
    path = check_file_target(path, force)
    tmp: Path | None = None
    out: BinaryIO | None = None
    try:
        # The temp file is created and known to the handlers below before an interrupt can
        # stop this function.
        with interrupts_deferred():
            try:
                fd, name = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
            except OSError as exc:
                raise os_error(exc, path) from exc
            tmp = Path(name)
            out = os.fdopen(fd, "wb")
        with out as f, _removed_on_sigbus(tmp):
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        keep_mode(tmp, path)
        put_in_place(tmp, path)
    except OSError as exc:
        discard(out, tmp)
        other = exc.filename
        writing = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
        if not writing and other is not None and os.fspath(other) not in (str(path), str(tmp)):
            # Another file failed, a source the body was reading: not a failure to write.
            raise InputError(
                f"{other}: cannot read: {exc.strerror or exc}", path=str(other)
            ) from exc
        raise os_error(exc, path) from exc
    except BaseException:
        discard(out, tmp)
        raise


def discard(out: BinaryIO | None, tmp: Path | None) -> None:
    """Close a temp file's handle and remove the file, where there are any; never raises."""
    if out is not None:
        with contextlib.suppress(OSError):
            out.close()
    if tmp is not None:
        remove(tmp)


@contextlib.contextmanager
def _removed_on_sigbus(path: Path) -> Iterator[None]:
    """While inside, an input that gets shorter under a memory-mapped read (which ends the
    process, see pulsectl._io.map_range) removes ``path`` first."""
    from pulsectl.codecs._fast import native

    token = -1 if native is None else native.add_cleanup(os.fsencode(path))
    try:
        yield
    finally:
        if native is not None and token >= 0:
            native.remove_cleanup(token)


def install(tmp: Path, path: Path) -> None:
    """Move a finished temp file or folder to ``path`` (replacing what is there).

    A folder cannot be renamed over a folder, so where the system can (Linux) the two are
    swapped in one step and ``path`` is at every moment the old folder or the new one; a kill
    -9 before the old one is removed leaves it under a temp name. Elsewhere: two renames, the
    first undone if the second fails or is interrupted.

    What a folder checkpoint leaves out of the old folder (hidden entries: ``.git``,
    ``.cache``) moves into the new one, and the new folder and its files take the old ones'
    modes. From the swap on, signals wait, and the old folder is first renamed aside to a
    ``.NAME.pulsectl-kept-*`` name of its own: a caller's clean-up of its temps (``tmp``, or a
    work folder holding it) never reaches it, and if carrying fails it stays there, named in
    the error.
    """
    if not (tmp.is_dir() and os.path.lexists(path)):
        if not tmp.is_dir():  # the replaced file's bits, else a new file's 0644 less the umask
            keep_mode(tmp, path)
        put_in_place(tmp, path)
        return
    folder = path.is_dir() and not path.is_symlink()  # a link is replaced, not followed
    with interrupts_deferred():
        if _exchange(tmp, path):
            old = tmp  # now the old folder (or file, or link)
        else:
            old = temp_path(path)
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
        _placed.record(path)
        if not folder:
            remove(old)
            return
        old = _set_aside(old, path)
        modes = _modes_of(old)  # before carrying makes any of its folders writable
        try:
            left = _carry_hidden(old, path)
        except OSError as exc:
            why = f"moving them failed ({exc.strerror or exc})"
            raise _kept(path, old, why) from exc
        if left:
            raise _kept(path, old, f"{left[0]} could not move: the new checkpoint has that name")
        _give_modes(path, modes)
        _discard(old)


def _set_aside(old: Path, path: Path) -> Path:
    """``old`` renamed to a fresh ``.NAME.pulsectl-kept-*`` beside ``path``; ``old`` itself if
    that fails (then a failure to carry leaves it where the caller's clean-up removes it)."""
    try:
        kept = Path(
            tempfile.mkdtemp(prefix=temp_prefix(path.name, ".pulsectl-kept-"), dir=path.parent)
        )
    except OSError:
        return old
    try:
        os.replace(old, kept)  # over the empty folder just made
    except OSError:
        with contextlib.suppress(OSError):
            kept.rmdir()
        return old
    return kept


def _kept(path: Path, old: Path, why: str) -> OutputError:
    return OutputError(
        f"{path}: written, but the old folder's hidden entries did not all move into it: {why}; "
        f"the old folder is kept as {old} (move what you need, then delete it)",
        path=path,
    )


def _carry_hidden(old: Path, new: Path) -> list[str]:
    """Move the entries below ``old`` that a folder checkpoint leaves out (a path component
    starting with '.') to the same place below ``new``; folders on the way are made. Returns
    the relative paths it could not move because ``new`` has something of that name."""
    left: list[str] = []
    _writable(old)  # it is going: its entries may be moved out of it
    for entry in os.scandir(old):
        src, dst = Path(entry.path), new / entry.name
        if entry.name.startswith("."):
            if os.path.lexists(dst):
                left.append(entry.name)
            else:
                _move(src, dst, entry.is_dir(follow_symlinks=False))
        elif entry.is_dir(follow_symlinks=False) and _holds_hidden(src):
            if not os.path.lexists(dst):
                dst.mkdir()
            if dst.is_dir() and not dst.is_symlink():
                left += [f"{entry.name}/{x}" for x in _carry_hidden(src, dst)]
            else:
                left.append(entry.name)
    return left


def _writable(folder: Path) -> None:
    """Let this user add and remove entries in ``folder`` (a read-only model folder, as
    downloads often are), where it may change its mode; root needs not."""
    mode = os.stat(folder).st_mode
    if not mode & stat.S_IWUSR:
        with contextlib.suppress(OSError):
            os.chmod(folder, stat.S_IMODE(mode) | stat.S_IWUSR)


def _move(src: Path, dst: Path, is_dir: bool) -> None:
    """rename(), for a folder without write permission too (moving a folder to another parent
    rewrites its '..'): write permission is added for the move and taken back after."""
    try:
        os.rename(src, dst)
        return
    except PermissionError:
        if not is_dir:
            raise
    mode = stat.S_IMODE(os.stat(src).st_mode)
    os.chmod(src, mode | stat.S_IWUSR)
    try:
        os.rename(src, dst)
    finally:
        os.chmod(dst if os.path.lexists(dst) else src, mode)


def _holds_hidden(folder: Path) -> bool:
    for _, dirs, files in os.walk(folder):
        if any(n.startswith(".") for n in (*dirs, *files)):
            return True
    return False


def _modes_of(folder: Path) -> dict[str, os.stat_result]:
    """The stat of ``folder`` ("") and of each visible file and folder below it, by relative
    path."""
    found = {"": os.stat(folder)}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in (*dirs, *files):
            if not name.startswith("."):
                there = Path(root) / name
                with contextlib.suppress(OSError):
                    found[there.relative_to(folder).as_posix()] = os.stat(there)
    return found


def _give_modes(new: Path, modes: dict[str, os.stat_result]) -> None:
    """Give folder ``new`` and each visible file and folder in it the mode (and owner, where
    allowed) recorded for the same relative path (a new file: what the old files had in common,
    ``_shared_by_files``); folders last, deepest first, so that a read-only one is made so once
    what is in it is done."""
    common = _shared_by_files(modes)
    folders = [""]
    for root, dirs, files in os.walk(new):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # carried over as they were
        rel = Path(root).relative_to(new)
        folders += [(rel / d).as_posix() for d in dirs]
        for name in files:
            if name.startswith("."):
                continue
            key = (rel / name).as_posix()
            if key in modes:
                _set_mode(new / key, modes[key])
            elif common is not None:
                common(new / key)
    for key in sorted(folders, key=lambda k: k.count("/") + (k != ""), reverse=True):
        if key in modes:
            _set_mode(new / key if key else new, modes[key])


def _shared_by_files(modes: dict[str, os.stat_result]) -> Callable[[Path], None] | None:
    """For a file new to a folder (a shard of a checkpoint sharded anew): what the old files
    had in common, as a function that gives it to a path: the permission bits every one of them
    has (so the new file is no more open than any of them: 0600 shards and a 0640 config give
    0600), and their owner and group where they all had one. None when there were no files
    (found in review: 0600 shards gained 0644 ones)."""
    files = [st for st in modes.values() if stat.S_ISREG(st.st_mode)]
    if not files:
        return None
    bits = functools.reduce(lambda a, b: a & b, (stat.S_IMODE(st.st_mode) for st in files))
    owners = {(st.st_uid, st.st_gid) for st in files}

    def give(path: Path) -> None:
        if len(owners) == 1:
            uid, gid = next(iter(owners))
            mine = os.stat(path)
            if (mine.st_uid, mine.st_gid) != (uid, gid):
                with contextlib.suppress(OSError):
                    os.chown(path, uid, gid)
        os.chmod(path, bits)

    return give


def _discard(folder: Path) -> None:
    """Remove the replaced folder, read-only folders in it too (this user's own)."""
    for root, dirs, _ in os.walk(folder):
        for d in (root, *(os.path.join(root, d) for d in dirs)):
            with contextlib.suppress(OSError):
                mode = os.stat(d, follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode) and not mode & stat.S_IWUSR:
                    os.chmod(d, stat.S_IMODE(mode) | stat.S_IRWXU)
    remove(folder)


def keep_mode(tmp: Path, path: Path) -> None:
    """Before ``tmp`` is renamed over ``path``: the bits and owner of ``path``, where it
    exists, else the usual 0644 less the umask."""
    _take_mode(tmp, path, 0o644 & ~_umask())


def _take_mode(tmp: Path, path: Path, default: int | None) -> None:
    """Give ``tmp`` the permission bits and owner of ``path``, which it is about to replace
    (like ``sed -i``: private weights stay private); ``default`` bits where there is no such
    file (None: leave them)."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or stat.S_ISDIR(st.st_mode) != tmp.is_dir():
        if default is not None:
            os.chmod(tmp, default)
        return
    _set_mode(tmp, st)


def _set_mode(path: Path, st: os.stat_result) -> None:
    """``path`` gets the owner (where allowed: only root may give a file away) and then the
    permission bits in ``st`` (chown clears set-user-ID bits, so it goes first)."""
    mine = os.stat(path)
    if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
        with contextlib.suppress(OSError):
            os.chown(path, st.st_uid, st.st_gid)
    if stat.S_ISDIR(st.st_mode) == stat.S_ISDIR(mine.st_mode):
        os.chmod(path, stat.S_IMODE(st.st_mode))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE) is True


def _renameat2(a: Path, b: Path, flags: int) -> bool | None:
    """Linux renameat2(a, b, flags): True done; False refused because ``b`` exists; None
    where the system has no such call or flag (not Linux, an old kernel or file system)."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return None
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return None
    raise OSError(err, os.strerror(err), str(b))


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def remove(path: Path) -> None:
    """Remove a file or folder if it exists; never raises."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_temp_of(path: Path, out: Path) -> bool:
    """Whether ``path`` is a temp written for ``out`` (beside it, named as pulsectl names its
    temps), or lies inside one (a temp folder's files)."""
    # The work folders' marks cut a long NAME shorter than the plain temp's does.
    prefixes = tuple(temp_prefix(out.name, TEMP_MARK + tag) for tag in _WORK_TAGS)
    folder = os.path.abspath(out.parent)
    for where in (path, *path.parents):
        if where.name.startswith(prefixes) and os.path.abspath(where.parent) == folder:
            return True
    return False


_WORK_TAGS = ("", "pull-", "cast-", "squash-")  # temps beside an output, and work folders


@contextlib.contextmanager
def naming_output(out: Path | None) -> Iterator[None]:
    """While inside, an OutputError that names a temp of ``out`` (a write that failed midway,
    its temp removed by now) is raised as ``out``'s: OUT is the name the user knows."""
    try:
        yield
    except OutputError as exc:
        if out is not None and exc.path is not None and is_temp_of(Path(exc.path), out):
            raise error_of_output(exc, out) from None
        raise


def error_of_output(exc: PulseError, out: Path) -> OutputError:
    """``exc``, which names a temp written for ``out`` (removed by now), as ``out``'s error:
    OUT is the name the user knows."""
    reason = exc.message
    for shown in (f"{exc.path}: ", f"{escape_controls(str(exc.path))}: "):
        reason = reason.removeprefix(shown)  # the message holds the path escaped
    return OutputError(f"{out}: {reason}", path=out)


def commit_outputs(writes: Sequence[tuple[Path, Callable[[Path], Any]]]) -> list[Any]:
    """Outputs that are one result (the block patches of one update): ``write(tmp)`` writes
    each to a temp file beside it, then all are moved into place as ``commit_together`` does.
    Returns what each ``write`` returned."""

    def write_each(tmps: list[Path]) -> list[Any]:
        return [write(tmp) for (_, write), tmp in zip(writes, tmps, strict=True)]

    result: list[Any] = commit_together([target for target, _ in writes], write_each)
    return result


def commit_together(targets: Sequence[Path], write: Callable[[list[Path]], T]) -> T:
    """Outputs that are one result, written by one pass (a LoCo patch and its residual):
    ``write(tmps)`` writes each target's temp file beside it, then all are moved into place,
    in order, with signals held. Nothing is replaced unless every output was written in full;
    an error that names a temp (or a temp of it) names its output. Returns what ``write``
    returned."""
    tmps: list[Path] = []
    try:
        for target in targets:
            tmps.append(temp_path(target))
        try:
            with _placed.unrecorded():  # the temps are not the outputs
                done = write(list(tmps))
        except PulseError as exc:
            named = _output_of(exc, tmps, targets)
            if named is None:
                raise
            raise error_of_output(exc, named) from None
        # All of them or, on an error, the first ones: never one without the others because
        # an interrupt came between them.
        with interrupts_deferred():
            for tmp, target in zip(tmps, targets, strict=True):
                try:
                    keep_mode(tmp, target)  # a replaced file keeps its bits
                    put_in_place(tmp, target)
                except OSError as exc:
                    raise os_error(exc, target) from exc
    except OSError as exc:
        raise os_error(exc, targets[max(len(tmps) - 1, 0)] if targets else Path(".")) from exc
    finally:
        for tmp in tmps:
            with contextlib.suppress(OSError):
                if tmp.exists():
                    remove(tmp)
    return done


def _output_of(exc: PulseError, tmps: Sequence[Path], targets: Sequence[Path]) -> Path | None:
    """The output whose temp ``exc`` names (the temp, or a temp made beside it for it); None
    for an error of anything else, an input read while writing among them."""
    if exc.path is None:
        return None
    named = Path(exc.path)
    for tmp, target in zip(tmps, targets, strict=True):
        if named == tmp or (
            named.parent == tmp.parent and named.name.startswith(temp_prefix(tmp.name))
        ):
            return target
    return None


def refuse_stdout_as_input(inputs: Sequence[object], what: str) -> None:
    """UsageError when standard output is a file among ``inputs`` (or inside a folder input):
    `diff A B > B`, `1<>B` or `>> B` would write the patch over NEW while it is read, and
    report a wrong patch as success. As `cat f >> f` refuses it."""
    try:
        out = os.fstat(1)
    except OSError:
        return
    if not stat.S_ISREG(out.st_mode):
        return
    try:
        where: str | None = os.readlink("/proc/self/fd/1")  # the path, where the system says
    except OSError:
        where = None
    for item in inputs:
        if not isinstance(item, (str, os.PathLike)) or os.fspath(item) == "-":
            continue
        try:
            st = os.stat(item)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino):
            # `> B` has emptied B before this process started: nothing here can undo that.
            emptied = (
                " (it is empty now: the shell's '>' emptied it first)" if not st.st_size else ""
            )
            raise UsageError(
                f"standard output is {os.fspath(item)}, an input of this command{emptied}; "
                f"write the {what} elsewhere"
            )
        if where is not None and stat.S_ISDIR(st.st_mode):
            try:
                refuse_inside_folder_input(where, [item], what)
            except UsageError:
                # The shell made the file before this process started: the folder holds it now.
                left = (
                    "; the shell's '>' has already made that file there, empty (a new file "
                    "the folder now holds, or one of its own, emptied)"
                    if not out.st_size
                    else ""
                )
                raise UsageError(
                    f"standard output is {where}, inside {os.fspath(item)}, a folder checkpoint "
                    f"this command reads{left}; write the {what} outside the folder"
                ) from None
