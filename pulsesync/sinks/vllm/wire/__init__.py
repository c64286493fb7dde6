"""What passes between the sidecar and the engine: update files, reply files, the weight-version string."""
