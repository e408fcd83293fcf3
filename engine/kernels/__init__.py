"""CPU matmuls in the layout each row count runs fastest: int4 and bfloat16 weights for a draft, oneDNN-packed
weights for a few rows, and the LM head with a float32 shortlist (lm_head); and the vocabulary-wide reductions the
engine reads each step on the host (vocab)."""
