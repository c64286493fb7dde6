"""The names of the state digest's algorithms, apart from their code (`digest.py`): settings read them without torch."""

from __future__ import annotations

from typing import Literal

DigestAlgorithm = Literal["mixsum-128", "xxh3-128", "sha256"]
DEFAULT_ALGORITHM: DigestAlgorithm = "mixsum-128"
