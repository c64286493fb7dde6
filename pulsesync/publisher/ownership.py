"""Prefix ownership: a publisher writes only into a prefix that is empty or carries its own stream.

A ready marker that is well-formed but of another stream (signed by another key, or by this key
for another stream id) means a second publisher: a conflict, never an interleaving, unless the
prefix is taken over explicitly (`take_over_prefix`). A marker that does not parse is junk, no
publisher's: counted, logged and skipped, so junk under ready/ cannot stop publishing.
"""

from __future__ import annotations

from dataclasses import dataclass

from pulsesync.errors import ConflictError, ForeignStreamError, IntegrityError, NotFoundError, UnknownKeyError
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest, PatchManifest, parse_manifest


@dataclass(frozen=True)
class OtherStream:
    """A well-formed ready marker of another publishing stream (its signature is not ours to check)."""

    key: str  # the marker's URL: the prefix and the key
    key_id: str
    stream_id: str

    def conflict(self, step: int) -> ConflictError:
        """The error that stops a publisher finding this marker in its prefix."""
        return ConflictError(
            f"step {step}: {self.key}, signed by key {self.key_id} for stream {self.stream_id or '-'}: "
            "another publisher writes to this prefix; refusing to interleave two streams (nothing was written; "
            "--take-over-prefix starts a new stream here)"
        )


async def classify(
    chain: ChainClient, step: int, kind: layout.Kind
) -> PatchManifest | AnchorManifest | OtherStream | None:
    """A listed marker: ours (verified), another stream's, or None (gone, or junk: rejected in `chain`)."""
    try:
        return await chain.manifest(step, kind)
    except NotFoundError:
        return None
    except (UnknownKeyError, ForeignStreamError) as e:
        try:
            other = parse_manifest(await chain.marker(step, kind), layout.ready_key(step, kind))
        except NotFoundError:
            return None
        except IntegrityError:  # does not even parse: junk, whoever's key id it names
            chain.reject(step, kind, e)
            return None
        return OtherStream(f"{chain.store.url}{layout.ready_key(step, kind)}", other.key_id, other.stream_id)
    except IntegrityError as e:  # forged with our key id, malformed, a replayed copy: no publisher wrote it
        chain.reject(step, kind, e)
        return None
