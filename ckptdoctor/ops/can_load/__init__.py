"""``ckptdoctor can-load``: will Megatron load this checkpoint at another layout (metadata only).

:mod:`.predict` runs the prediction over the sections; :mod:`.run` is the loading run (target layout, flags,
args), :mod:`.args` its startup and post-load args checks, :mod:`.keys` and :mod:`.shapes` the model keys it
requests and their global shapes, :mod:`.optim` the optimizer section."""
