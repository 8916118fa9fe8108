"""Phase two: the candidates re-decoded teacher-forced, in chunks, each chunk back-propagated at once, so the
gradient is the whole batch's whatever the chunking. `rescoring.rescore_backward` is its entry point; `chunkplan`
plans every chunk on the host, `prefixtree` lays the candidates out as their prefix tree, `tokenweights` reads a
token-level objective's weights from the log-probabilities it decodes.

It reads phase one's `twophase.samples.Samples` and imports nothing from phase one.
"""
