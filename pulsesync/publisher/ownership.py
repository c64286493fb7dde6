"""Prefix ownership: a publisher writes only into a prefix that is empty or carries its own stream.

A ready marker that is well-formed but of another stream (signed by another key, or by this key
for another stream id) means a second publisher: a conflict, never an interleaving, unless the
prefix is taken over explicitly (`take_over_prefix`). A marker that does not parse is junk, no
publisher's: counted, logged and skipped, so junk under ready/ cannot stop publishing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pulsesync.errors import ConflictError, ForeignStreamError, IntegrityError, NotFoundError, UnknownKeyError
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest, PatchManifest, parse_manifest

log = logging.getLogger("pulsesync.publisher")


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


async def classify(chain: ChainClient, step: int) -> PatchManifest | AnchorManifest | OtherStream | None:
    """A listed step's commit: ours (verified), another stream's, or None (gone, or junk: rejected in `chain`)."""
    while (key := chain.index.commit_key_of(step)) is not None:  # a legacy step's other marker after a junk one
        try:
            return await chain.commit_manifest(step)
        except NotFoundError:
            continue
        except (UnknownKeyError, ForeignStreamError) as e:
            try:
                other = parse_manifest(await chain.marker(key), key)
            except NotFoundError:
                continue
            except IntegrityError:  # does not even parse: junk, whoever's key id it names
                chain.reject(key, e)
                continue
            return OtherStream(f"{chain.store.url}{key}", other.key_id, other.stream_id)
        except IntegrityError as e:  # forged with our key id, malformed, a replayed copy: no publisher wrote it
            chain.reject(key, e)
    return None


async def newest_own(chain: ChainClient, take_over: bool, new_stream: str) -> tuple[int | None, int]:
    """The newest listed step whose commit is ours, and the step new ones must follow (-1: any).

    ConflictError at a newer commit of another stream. Junk markers are skipped (a forged
    far-future key must not stop publishing). With `take_over`, another stream's commit ends the
    search instead: the publisher starts stream `new_stream`, with steps newer than that commit's.
    """
    for step in sorted(chain.listed, reverse=True):
        found = await classify(chain, step)
        if isinstance(found, OtherStream):
            if not take_over:
                raise found.conflict(step)
            log.warning(
                "taking over %s: it holds %s (key %s, stream %s); a new stream %s starts with an anchor after step %d",
                chain.store.url,
                found.key,
                found.key_id,
                found.stream_id or "-",
                new_stream,
                step,
            )
            return None, step
        if found is not None:
            return step, -1
    return None, -1


@dataclass
class PrefixGuard:
    """Watches a prefix for other publishers between steps: one listing after the last key seen per step."""

    chain: ChainClient
    own: set[str] = field(default_factory=set)  # ready markers we wrote and the listing has not passed yet

    def wrote(self, key: str) -> None:
        """Remember a marker this publisher is writing, so the next listing does not take it for another's."""
        self.own.add(key)

    async def scan(self) -> set[int]:
        """The steps others committed since the last scan."""
        found = {entry.step for entry, info in await self.chain.refresh() if info.key not in self.own}
        seen = self.chain.index.last_key or ""
        self.own = {k for k in self.own if k > seen}  # only markers not listed yet matter
        return found

    async def check(self, step: int) -> None:
        """ConflictError if another publisher (another stream, or ours) committed to the prefix since the last look."""
        for other in sorted(await self.scan()):
            found = await classify(self.chain, other)
            if isinstance(found, OtherStream):
                raise found.conflict(step)
            if found is not None:  # signed by our key for our stream: a copy of this job
                raise ConflictError(
                    f"step {step}: another publisher wrote step {other} to {self.chain.store.url}; stopping so "
                    "the chain does not fork"
                )
