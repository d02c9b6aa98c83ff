"""``epd bench``: side-by-side benchmarks (each compares configurations in one run)."""
