"""relaygr.bench: the worker micro-benchmarks, one process each, printing JSON lines.

The model, the store and its links, the attention kernels, device operations per ranking, the
cold-tier formats, ``relaygr plan`` against an engine run, the files a request runs through, and
the ranking worker's host cost per ranking. The broker scenarios are experiment kinds
(``tools.experiment.scenarios``); the accelerator check is ``device``.
"""
