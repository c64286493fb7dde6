"""The ready index: the steps a prefix's listings showed, the kinds known of each, and their marker keys.

Pure bookkeeping, no I/O: the chain client (`chain.py`) lists the store and feeds each key here;
what a marker says is trusted only once the client verified it. A commit key (`ready/{step}.json`)
is listed with kind None until a verified manifest tells it (`resolved`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pulsesync.protocol import layout


@dataclass
class ReadyIndex:
    """What the listings after `last_key` (and `last_anchor_key`) have shown."""

    steps: dict[int, set[layout.Kind]] = field(default_factory=dict)  # the kinds known of each listed step
    keys: dict[tuple[int, layout.Kind], str] = field(default_factory=dict)  # the marker key of each (step, kind)
    unresolved: dict[int, str] = field(default_factory=dict)  # commit keys whose kind no manifest told yet
    last_key: str | None = None  # the last commit or patch marker listed: the next listing starts after it
    last_anchor_key: str | None = None  # the same for the anchors added to patch steps

    def clear(self) -> None:
        """Forget everything: the next listing starts from the beginning."""
        self.steps, self.keys, self.unresolved = {}, {}, {}
        self.last_key = self.last_anchor_key = None

    def listed(self, key: str) -> layout.ReadyEntry | None:
        """Take a key of the ready listing; its entry, or None for a key that is not a marker.

        Only a marker advances the position: a stray key (notes.txt, _SUCCESS) sorts after
        every step and would hide the markers published after it.
        """
        entry = layout.parse_ready_key(key)
        if entry is None:
            return None
        self.last_key = key
        self.steps.setdefault(entry.step, set())
        if entry.kind is None:
            self.unresolved[entry.step] = key
        else:
            self.learn(entry.step, entry.kind, key)
        return entry

    def listed_anchor(self, key: str) -> int | None:
        """Take a key of the added anchors' listing; its step, or None for a key that is not one."""
        step = layout.parse_anchor_ready_key(key)
        if step is None:
            return None
        self.last_anchor_key = key
        self.steps.setdefault(step, set())
        if (step, "anchor") not in self.keys:  # an anchor that is the step's commit comes first
            self.learn(step, "anchor", key)
        return step

    def learn(self, step: int, kind: layout.Kind, key: str) -> None:
        """A step has a marker of this kind under this key."""
        self.keys[(step, kind)] = key
        self.steps.setdefault(step, set()).add(kind)

    def resolved(self, step: int, kind: layout.Kind, key: str) -> None:
        """A verified manifest told the kind of a step's marker (the commit decides it, over a listed anchor)."""
        if self.unresolved.get(step) == key:
            del self.unresolved[step]
        self.learn(step, kind, key)

    def commit_key_of(self, step: int) -> str | None:
        """The key of the marker that commits a step: its commit key, or in legacy prefixes its patch marker
        (else its anchor marker); None if none is listed."""
        if step in self.unresolved:
            return self.unresolved[step]
        return self.keys.get((step, "patch")) or self.keys.get((step, "anchor"))

    def key_of(self, step: int, kind: layout.Kind) -> str | None:
        """The key of a step's marker of a kind, as listed; None if none is known."""
        return self.keys.get((step, kind))

    @property
    def marker_keys(self) -> set[str]:
        """Every marker key listed."""
        return {*self.keys.values(), *self.unresolved.values()}

    def forget(self, key: str) -> None:
        """Drop a marker (removed from the store, or refused); a step left with no marker is dropped too."""
        for (step, kind), known in list(self.keys.items()):
            if known == key:
                del self.keys[(step, kind)]
                self.steps.get(step, set()).discard(kind)
        for step, known in list(self.unresolved.items()):
            if known == key:
                del self.unresolved[step]
        for step in {s for s, kinds in self.steps.items() if not kinds and s not in self.unresolved}:
            del self.steps[step]

    def list_again_after_kept(self) -> None:
        """List again after the newest marker kept: those published after a refused far-future one sort before it."""
        kept = self.marker_keys
        self.last_key = max((k for k in kept if k.startswith(layout.READY_PREFIX)), default=None)
        self.last_anchor_key = max((k for k in kept if k.startswith(layout.ANCHOR_READY_PREFIX)), default=None)
