"""Rows to tensors: the formats of the training files (SFT, preference, unpaired), tokenization, the
example store on disk, packing and collation."""
