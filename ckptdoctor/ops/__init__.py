"""Operations: pure functions over Checkpoint objects that return report data (they never print)."""
