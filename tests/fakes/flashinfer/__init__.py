"""A fake FlashInfer package (only `msa_ops`)."""
