"""simharness: simulate and profile async speculative-decoding scheduling."""
