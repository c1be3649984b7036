"""The HSTU ranker and its three forwards.

Entry points: ``model.HSTURanker`` (a checkpoint's model), ``runner.ModelRunner`` (serving it:
``prefill``, ``extend``, relay and full ranking against a ``PrefixKV`` in the device tier's pages,
eager or from CUDA graphs), ``presets`` (named sizes), ``vocab`` (raw ids to model ids),
``devices`` (cpu, cuda, npu and dtypes). Attention arithmetic lives in the kernel
layer; the model calls it and never sees which implementation ran.
"""
