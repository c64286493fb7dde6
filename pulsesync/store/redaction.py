"""Credentials kept out of logs: botocore's debug log prints request headers, secrets included."""

from __future__ import annotations

import logging
import os
import re

_SECRET_HEADER = re.compile(
    r"((?:x-amz-security-token|aws_session_token|aws_secret_access_key|SessionToken|SecretAccessKey)"
    r"""['"]?\s*[:=]\s*b?['"]?)[^'",\s}]+""",
    re.IGNORECASE,
)


class RedactCredentials(logging.Filter):
    """Blanks AWS secrets (session token, secret key) in log records: botocore's debug log prints its headers."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message with every secret replaced; never drops a record."""
        message = record.getMessage()
        redacted = _SECRET_HEADER.sub(r"\1<redacted>", message)
        for name in ("AWS_SESSION_TOKEN", "AWS_SECRET_ACCESS_KEY"):
            if secret := os.environ.get(name):
                redacted = redacted.replace(secret, "<redacted>")
        if redacted != message:
            record.msg, record.args = redacted, None
        return True
