"""Storage failures as users read them: one line, a reason class, never a credential.

Every error text taken from a client library is stripped of the values of the location's
`storage_options` and of the credential variables of the environment (which the client libraries
read when `storage_options` has none) before it reaches an exception, a log line or a report.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["StorageError", "failure_message", "redact"]

#: Environment variables whose values are redacted from error texts too: the client libraries
#: read credentials from them when `storage_options` has none.
_CREDENTIAL_ENV = re.compile(
    r"^(AWS|AZURE|GOOGLE|GCS|GCP|GCLOUD)_"
    r"|(^|_)(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS?|SAS|CONNECTION_STRING)(_|$)"
)
#: Shorter values are not redacted: they are flags and numbers, and replacing them would mangle
#: every message while hiding nothing.
_MIN_SECRET_LEN = 4
_MAX_DETAIL = 200


class StorageError(OSError):
    """A storage operation failed (unreachable endpoint, refused credentials, missing bucket, ...).

    The message is one line: what was done, the URL, a reason class and the client's own error
    with every credential value removed.
    """


def failure_message(action: str, where: str, exc: BaseException, options: Mapping[str, Any]) -> str:
    """``"<action> <where>: <reason> (<type>: <the client's text>)"``, without any credential."""
    detail = " ".join(str(exc).split())[:_MAX_DETAIL]
    detail = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return redact(f"{action} {where}: {_reason(exc)} ({detail})", options)


def _secrets(options: Mapping[str, Any]) -> list[str]:
    found: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, str):
            if len(value) >= _MIN_SECRET_LEN:
                found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                collect(item)

    collect(options)
    for name, value in os.environ.items():
        if _CREDENTIAL_ENV.search(name.upper()):
            collect(value)
    # Longest first, so that a secret that contains another is replaced whole.
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, options: Mapping[str, Any]) -> str:
    """`text` with every value of `options` and of the environment's credential variables
    replaced by ``***``."""
    for secret in _secrets(options):
        text = text.replace(secret, "***")
    return text


def _reason(exc: BaseException) -> str:
    """The class of a failure, from the exception's type (each client library has its own)."""
    names = " ".join(cls.__name__ for cls in type(exc).__mro__)
    if isinstance(exc, FileNotFoundError) or "NoSuch" in names or "NotFound" in names:
        return "not found (no such bucket, container or path)"
    if isinstance(exc, PermissionError) or any(
        word in names for word in ("Credential", "AccessDenied", "Auth", "Forbidden", "Refresh")
    ):
        return "access denied (credentials or permissions)"
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(
        word in names for word in ("Connect", "Timeout")
    ):
        return "endpoint unreachable"
    return "failed"
