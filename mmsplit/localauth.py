"""The local token: how a scheduler on loopback admits only its own user.

Loopback is not a boundary between users: any local user, and any container
of a pod, can connect to 127.0.0.1. So a scheduler serving loopback with no
credentials configured makes a random token, requires it on every call but
health checks, and writes it to a file in the **runtime directory**, a
directory only the services' user may enter (mode 0700, owned by it), named
by the port (`scheduler-<port>.token`). A client of the same user on the
same host (the tokenizer, `mmsplit info`, the tests) reads it there when it
calls a loopback address of that port with no token of its own; another
user cannot read it, so its calls are refused UNAUTHENTICATED. This is the
permission model of a Unix socket in a private directory, kept over TCP so
that every address, port and probe the deployment already uses stays as it
is.

The runtime directory: `--runtime-dir` (the `MMSPLIT_RUNTIME_DIR` variable),
else `$XDG_RUNTIME_DIR/mmsplit`, else `/tmp/mmsplit-<uid>`. It must be a real
directory (not a symlink) owned by this user with no access for group or
others, and is created so when missing; anything else is refused, since
someone else could read a token put there (as ssh-agent and tmux check
theirs). Containers of one pod share it through an `emptyDir` mounted at the
same path in both (`deploy/overlays/single-pod`).

Standard library only: the light client uses it too.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import stat
from pathlib import Path

AUTHORIZATION = "authorization"


class RuntimeDirError(ValueError):
    """The runtime directory is not private to this user."""


def runtime_dir(setting: str = "") -> Path:
    """The runtime directory a service's `--runtime-dir` names, else the default."""
    return Path(setting) if setting else default_dir()


def default_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get("MMSPLIT_RUNTIME_DIR"):
        return Path(env["MMSPLIT_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "mmsplit"
    return Path(f"/tmp/mmsplit-{os.geteuid()}")


def private_dir(path: Path, *, create: bool) -> Path:
    """`path`, checked to be a directory only this user can enter (made so
    when missing and `create`); RuntimeDirError otherwise."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise RuntimeDirError(f"{path}: no such directory") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"{path}: not a directory (a symlink or a file is not accepted)")
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(f"{path}: owned by uid {st.st_uid}, not this user ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise RuntimeDirError(f"{path}: mode {stat.S_IMODE(st.st_mode):o}; it must be 700 (no access for others)")
    return path


def token_path(directory: Path, port: int) -> Path:
    return directory / f"scheduler-{port}.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def provision(directory: Path, port: int, token: str) -> Path:
    """Write `token`, the scheduler's on `port`, to its file (0600) in the
    private `directory`; the file."""
    private_dir(directory, create=True)
    path = token_path(directory, port)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)  # a client never reads half a token
    return path


def withdraw(path: Path, token: str) -> None:
    """Remove the token file if it still holds `token` (a scheduler started
    on the same port since then keeps its own). Never raises."""
    with contextlib.suppress(OSError):
        if path.read_text() == token:
            path.unlink()


def is_local(target: str) -> int:
    """The port of a loopback gRPC target (`127.0.0.1:P`, `[::1]:P`,
    `localhost:P`, with or without `ipv4:`/`ipv6:`/`dns:` schemes); 0 for
    any other."""
    for scheme in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return 0
    host = host.strip("[]")
    if host == "localhost":
        return int(port)
    try:
        return int(port) if ipaddress.ip_address(host).is_loopback else 0
    except ValueError:
        return 0


class LocalToken:
    """What a client calling `target` presents when it has no token of its
    own: the local token of the scheduler on that loopback port, read from
    the runtime directory (again whenever the file changes: a restarted
    scheduler writes a new one). Nothing for any other target, or when
    there is no such file or the directory is not private."""

    def __init__(self, target: str, directory: Path | None = None) -> None:
        self.port = is_local(target)
        self.directory = directory or default_dir()  # a client without settings: the default
        self._seen: tuple[int, int, int] | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if not self.port:
            return ()
        path = token_path(self.directory, self.port)
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._seen:
                private_dir(self.directory, create=False)
                if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                    return ()
                self._metadata = ((AUTHORIZATION, f"Bearer {path.read_text().strip()}"),)
                self._seen = key
        except (OSError, RuntimeDirError):
            self._seen = None
            self._metadata = ()
        return self._metadata
