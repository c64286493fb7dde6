"""The vLLM sinks, arranged by the side of the process boundary their code runs on.

- `sidecar/`: what the pulsesync subscriber runs: the sink (what to send, the pause around it),
  its sessions with an engine (HTTP, in-process `vllm.LLM`, worker extension), the LoRA sink.
- `engine/`: what vLLM loads into its own processes: the weight-transfer backend and its plugin,
  the worker extension, the transactional applier, the module twins, where each tensor lives.
- `wire/`: what passes between them: the update file, the per-rank reply files, the weight-version
  string every engine path (and SGLang's) answers. Engine-side modules import only the wire.
"""
