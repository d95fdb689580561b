"""The coordinator: owns every session's committed tokens and runs the speculative round loop."""
