"""The broadcast baseline's trainer half: buckets of full HF tensors broadcast from rank 0."""
