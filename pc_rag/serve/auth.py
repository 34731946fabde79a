"""Who may use a `pc-rag serve`: API keys and the tenant each one belongs to, and the Host names a key-less
loopback server answers.

Keys come from `--api-key KEY` (repeatable), `--api-keys FILE` and the environment ($PC_RAG_API_KEY, one key;
$PC_RAG_API_KEYS, entries separated by newlines or commas). A file and $PC_RAG_API_KEYS hold one entry per line,
`KEY [TENANT]`, with `#` comments and blank lines; several keys may name one tenant. A key given without a
tenant is a tenant of its own, named after a hash of the key (`key-<12 hex>`), never after the key itself, so
that the name can go into logs and into the cache namespace (`blocks.tenant_namespace`). Keys on the command
line are visible to every local user in /proc/<pid>/cmdline: the file (mode 600) or the environment are the
ways to pass them.

A request's bearer token is compared as bytes (a header is Latin-1 to Starlette; a non-ASCII token is a 401,
never a 500) and by its SHA-256 digest against every key's, each compared in constant time, so neither the
time nor the key's length tells how much of a guess was right.

DNS rebinding: a web page on any site can make the browser send requests to 127.0.0.1 under its own host name,
and read the answers. A loopback server without keys therefore answers only requests whose `Host` names
loopback (`localhost`, `127.0.0.1`, `[::1]`, any port) or a name given with `--allowed-host`; others get 421.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import PCRagError

# Printable ASCII without spaces: what every HTTP client can put in an Authorization header as it is.
_KEY = re.compile(r"[\x21-\x7e]+")
# Tenant names are mixed into cache namespaces and shown in logs: short and plain.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class KeyFileError(PCRagError, ValueError):
    """A malformed key entry; the message names the file (or variable) and the line."""


@dataclass(frozen=True)
class APIKey:
    key: str
    tenant: str  # as given, or "key-<12 hex of the key's SHA-256>"
    source: str  # where it was given, for messages: "--api-key", "keys.txt:3", "$PC_RAG_API_KEYS:2"

    @staticmethod
    def of(key: str, tenant: str | None, source: str) -> APIKey:
        if not key or not _KEY.fullmatch(key):
            raise KeyFileError(f"{source}: the API key is empty or holds a character outside printable ASCII "
                               f"(spaces included); use letters, digits and punctuation")
        if tenant is not None and not _TENANT.fullmatch(tenant):
            raise KeyFileError(f"{source}: tenant {tenant!r} must be 1-64 letters, digits, '.', '_' or '-', "
                               f"starting with a letter or digit")
        return APIKey(key, tenant or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12], source)


def parse_keys(text: str, source: str, commas: bool = False) -> list[APIKey]:
    """The entries of a key file's text, `KEY [TENANT]` per line (`commas`: also separated by commas, as in
    $PC_RAG_API_KEYS). `source` names the file or variable in errors, with the line number."""
    keys = []
    for n, line in enumerate(text.splitlines(), start=1):
        for entry in line.split(",") if commas else [line]:
            entry = entry.split("#", 1)[0].strip()
            if not entry:
                continue
            fields = entry.split()
            if len(fields) > 2:
                raise KeyFileError(f"{source}:{n}: expected 'KEY [TENANT]', got {len(fields)} fields (a key holds "
                                   f"no spaces)")
            keys.append(APIKey.of(fields[0], fields[1] if len(fields) == 2 else None, f"{source}:{n}"))
    return keys


def read_keys_file(path: str | os.PathLike) -> list[APIKey]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"--api-keys {path}: cannot read it ({e})") from None
    keys = parse_keys(text, str(path))
    if not keys:
        raise KeyFileError(f"--api-keys {path}: no keys in it (lines 'KEY [TENANT]')")
    return keys


def gather_keys(cli_keys: Sequence[str] = (), keys_file: str | os.PathLike | None = None,
                environ: dict | None = None) -> list[APIKey]:
    """Every key the server accepts: `--api-key` values, else $PC_RAG_API_KEY; the `--api-keys` file;
    $PC_RAG_API_KEYS. A key given twice with two tenants is an error naming both places; either variable set but
    holding no key is an error (unset, it means no key)."""
    environ = os.environ if environ is None else environ
    keys = [APIKey.of(k.strip(), None, "--api-key") for k in cli_keys]
    # A variable that is set but holds no key is a deployment whose secret did not arrive: refused as `--api-key ""`
    # is, rather than read as "no auth" (which would serve anyone).
    if not cli_keys and "PC_RAG_API_KEY" in environ:
        if not environ["PC_RAG_API_KEY"].strip():
            raise KeyFileError("$PC_RAG_API_KEY is set but empty; give it a key, or unset it for no auth")
        keys.append(APIKey.of(environ["PC_RAG_API_KEY"].strip(), None, "$PC_RAG_API_KEY"))
    if keys_file is not None:
        keys += read_keys_file(keys_file)
    if "PC_RAG_API_KEYS" in environ:
        found = parse_keys(environ["PC_RAG_API_KEYS"], "$PC_RAG_API_KEYS", commas=True)
        if not found:
            raise KeyFileError("$PC_RAG_API_KEYS is set but holds no key ('KEY [TENANT]' entries); give it keys, or "
                               "unset it for no auth")
        keys += found
    seen: dict[str, APIKey] = {}
    for k in keys:
        if k.key in seen and seen[k.key].tenant != k.tenant:
            raise KeyFileError(f"{k.source}: this key was given for tenant {seen[k.key].tenant!r} at "
                               f"{seen[k.key].source} and for {k.tenant!r} here")
        seen.setdefault(k.key, k)
    return list(seen.values())


class KeyRing:
    """The accepted keys, as digests; `tenant(token)` is the tenant of a bearer token, or None."""

    def __init__(self, keys: Iterable[APIKey]):
        self._digests = [(hashlib.sha256(k.key.encode()).digest(), k.tenant) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def tenant(self, token: bytes) -> str | None:
        digest = hashlib.sha256(token).digest()
        found = None
        for known, tenant in self._digests:  # every key compared, a match or not
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


def bearer_token(authorization: str) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header as the bytes the client sent (Starlette decodes
    headers as Latin-1), or None when the header is missing or of another scheme."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("latin-1")


def is_loopback(host: str) -> bool:
    """Whether a bind address is this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(header: str) -> str:
    """The name of a `Host` header, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header
