"""Built-in models: the LSTM encoder-decoder (`seq2seq`) with its fused kernels (`fused`, `outputlayer`), the Karel
synthesisers (`karel`: pooled pairs; `karel_paper`: Bunel et al.'s IOs2Seq), and adapters for other libraries'
models (`hf`, needs the `hf` extra). Nothing in the core imports this package."""
