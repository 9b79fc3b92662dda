"""What a location may say and what a storage message may show: URLs that carry credentials are refused, and no
secret the process knows of reaches an error.

A credential in a URL would travel into logs, metadata and every message that names the object, so such a URL is
refused without being repeated; the backends name objects only through `shown` and pass every store error through
`scrub`.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any

from ucp_deepspeed.errors import CheckpointError

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
"""A URL's scheme, the first group of a match; a location it does not match is a local path."""
_SECRET_QUERY = re.compile(r"(secret|token|signature|password|credential|sig|key)", re.IGNORECASE)

# Secret values the process knows of: every error raised from a store is scrubbed of them.
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_KEY")
_SECRET_OPTION = re.compile(r"(secret|token|key|password|credential)", re.IGNORECASE)


class StorageError(CheckpointError):
    """A storage operation failed (unreachable, refused, missing bucket); names the object, never a secret."""


def is_url(location: str) -> bool:
    """Whether a location is a URL (`scheme://...`) rather than a local path; `file://` counts as a URL."""
    return bool(SCHEME.match(str(location)))


def shown(location: str) -> str:
    """A location as it may appear in a message: any user info and query removed."""
    parts = urllib.parse.urlsplit(location)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def check_url(location: str) -> None:
    """Refuse a URL that carries credentials: they would reach logs, metadata and every error message."""
    parts = urllib.parse.urlsplit(location)
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    if userinfo or any(_SECRET_QUERY.search(k) for k, _ in urllib.parse.parse_qsl(parts.query)):
        raise StorageError(
            shown(location),
            "the URL carries credentials, which are refused (they would reach logs and errors); give them through "
            "the AWS environment variables or config files, or the `storage_options` config key",
        )


def _secrets(options: dict[str, Any]) -> list[str]:
    found = [os.environ.get(name, "") for name in _SECRET_ENV]

    def walk(obj: Any, secret: bool = False) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, secret or bool(_SECRET_OPTION.search(str(k))))
        elif isinstance(obj, str) and secret:
            found.append(obj)

    walk(options)
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def scrub(text: str, options: dict[str, Any] | None = None) -> str:
    """`text` with every secret value known to the process replaced by `***`."""
    for secret in _secrets(options or {}):
        text = text.replace(secret, "***")
    return text
