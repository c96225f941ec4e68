"""Local text -> the trainer's token files: document sources, an offline BPE tokenizer, `mosaic data prepare`."""
