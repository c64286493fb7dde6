"""What vLLM loads into its own processes: the pulsesync backend and worker extension, and what they run."""
