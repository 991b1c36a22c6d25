"""Tiny random-weight checkpoints the project writes itself, in the released models' layouts, so
the real loading and model code runs without a download (``model: tiny:NAME``). Not product
code: a real checkpoint folder replaces them by changing the path."""
