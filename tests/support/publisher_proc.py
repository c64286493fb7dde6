"""A publisher process for crash tests.

`python -m tests.support.publisher_proc STORE_DIR KEY FIRST LAST [STALL_STEP FLAG]`

Publishes the synthetic trainer's steps FIRST..LAST (resuming from the store when it holds steps).
With STALL_STEP it blocks right before writing that step's patch ready marker (after the payload
is uploaded) and creates FLAG, so the test can kill it with SIGKILL at exactly that point.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pulsesync.protocol.layout import commit_key
from pulsesync.protocol.signing import load_private_key
from pulsesync.publisher import Publisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.store import FileStore
from tests.support.helpers import trainer_states
from tests.support.recording_store import RecordingStore, stall_forever


def main(argv: list[str]) -> None:
    store_dir, key, first, last = Path(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3])
    stall = int(argv[4]) if len(argv) > 4 else None
    flag = Path(argv[5]) if len(argv) > 5 else None

    def hook(op: str, k: str) -> None:
        if stall is not None and flag is not None and k == commit_key(stall):
            stall_forever(flag)

    store = RecordingStore(FileStore(store_dir), hook)
    config = PublisherConfig(anchor_interval=10, on_backpressure="block", resume=True)
    with Publisher(config, store=store, signing_key=load_private_key(key)) as publisher:
        for step, state in enumerate(trainer_states(last + 1)):
            if step >= first:
                publisher.publish(step, state)


if __name__ == "__main__":
    main(sys.argv[1:])
