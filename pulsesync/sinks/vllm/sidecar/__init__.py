"""What the pulsesync sidecar runs beside a vLLM engine: the sink, its sessions, the LoRA sink."""
