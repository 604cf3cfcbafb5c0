"""What a rank measures for the notebook, per cell or per request: memory, the notebook lines it
ran, a profile, tensor checksums and fingerprints. Each is off or cheap unless asked."""
