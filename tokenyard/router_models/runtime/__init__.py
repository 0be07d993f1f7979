"""What the gateway runs: features, the scorer, the checksummed artifact and threshold calibration.
Pure: no I/O beyond loading the artifact."""
