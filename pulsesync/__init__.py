"""pulsesync: lossless sparse weight sync from RL trainers to inference servers (the PULSE method)."""

__version__ = "0.1.0"
